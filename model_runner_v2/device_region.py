"""MemoryRegion: one contiguous byte buffer whose memory can be given back and taken again (sleep mode).

An engine built with `enable_sleep_mode` keeps its weights and its KV cache in regions. `release()` returns a
region's memory to the device (its contents first copied to pinned host memory when asked); `restore()` takes
memory again and puts the contents back. Every tensor viewing the region stays valid across the pair.

On CUDA the address must not change either: the CUDA graphs captured at start-up hold raw pointers into the
weights and the KV cache. CUDA's virtual memory API separates the two halves of an allocation, so a region
reserves its virtual address range once, for its whole life, and maps physical pages into it on `restore()` and
unmaps them on `release()` (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemUnmap / cuMemRelease through
ctypes from the driver library torch has loaded). torch sees the range through `__cuda_array_interface__`, a
zero-copy view whose storage keeps the region object alive. On the CPU no graph holds addresses: the region
is an ordinary tensor whose storage is resized to 0 bytes and back (tensors viewing it keep working).
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod

import torch

_ALIGN = 256  # bytes between two tensors laid out in a region: every dtype's alignment, and the kernels' loads


def aligned(nbytes: int, align: int = _ALIGN) -> int:
    return (nbytes + align - 1) // align * align


class MemoryRegion(ABC):
    """`buffer`: uint8 [nbytes] on the region's device. Views of it (`view()`) survive release/restore."""

    buffer: torch.Tensor
    nbytes: int

    def __init__(self) -> None:
        self.released = False
        self._kept = False  # whether the latest release copied the contents out
        self._host: torch.Tensor | None = None  # the contents while released with keep=True

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of `dtype` and `shape` at byte `offset` (a multiple of the dtype's size)."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def release(self, keep: bool) -> None:
        """Give the memory back; keep=True first copies the contents to host memory (pinned on CUDA). The caller
        has synchronized: nothing may still read or write the region."""
        if self.released:
            return
        if keep:
            if self._host is None or self._host.numel() != self.nbytes:
                self._host = torch.empty(self.nbytes, dtype=torch.uint8,
                                         pin_memory=self.buffer.device.type == "cuda")
            self._host.copy_(self.buffer)
        self._unmap()
        self.released = True
        self._kept = keep

    def restore(self) -> bool:
        """Take memory again at the same place; returns True when the contents came back, False when they were
        not kept (then the region is zero-filled: a KV cache must hold no NaN, see kv_cache.allocate)."""
        if not self.released:
            return True
        self._map()
        self.released = False
        if self._kept:
            self.buffer.copy_(self._host, non_blocking=True)
        else:
            self.buffer.zero_()
        if self.buffer.device.type == "cuda":
            torch.cuda.current_stream(self.buffer.device).synchronize()  # the host copy may be reused next
        return self._kept

    def drop_host_copy(self) -> None:
        """Free the pinned host copy (kept between sleeps so the next sleep does not pin again)."""
        self._host = None

    @abstractmethod
    def _unmap(self) -> None: ...

    @abstractmethod
    def _map(self) -> None: ...

    @abstractmethod
    def free(self) -> None:
        """Give everything back for good (the engine is shutting down); views must not be used afterwards."""


def make_region(nbytes: int, device: torch.device) -> MemoryRegion:
    return CudaRegion(nbytes, device) if device.type == "cuda" else HostRegion(nbytes, device)


class HostRegion(MemoryRegion):
    """A CPU region: a uint8 tensor whose storage shrinks to nothing while released."""

    def __init__(self, nbytes: int, device: torch.device):
        super().__init__()
        self.nbytes = max(nbytes, 1)
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)

    def _unmap(self) -> None:
        self.buffer.untyped_storage().resize_(0)

    def _map(self) -> None:
        self.buffer.untyped_storage().resize_(self.nbytes)

    def free(self) -> None:
        self._unmap()
        self._host = None


# -- CUDA driver API (cuda.h), the virtual memory management part ------------------------------------------------
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


_driver: ctypes.CDLL | None = None


def _cu(name: str, *args) -> None:
    """Call a driver function; a non-zero CUresult is a RuntimeError with the driver's text (out of memory on
    restore: a colocated trainer still holds what the engine gave back)."""
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    result = getattr(_driver, name)(*args)
    if result != 0:
        text = ctypes.c_char_p()
        _driver.cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{name} failed: CUDA error {result} ({(text.value or b'?').decode()})")


class _CudaArray:
    """What torch.as_tensor wraps without copying: `nbytes` bytes at `ptr`; the tensor's storage holds this object,
    which holds the region, so the address range outlives every view of it."""

    def __init__(self, ptr: int, nbytes: int, owner: CudaRegion):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}
        self.owner = owner


class CudaRegion(MemoryRegion):
    """A CUDA region: a virtual address range reserved for the region's life; physical pages mapped while
    awake."""

    def __init__(self, nbytes: int, device: torch.device):
        super().__init__()
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._prop = _AllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location = _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, self.device.index)
        granularity = ctypes.c_size_t()
        _cu("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self._prop),
            _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        self.nbytes = aligned(max(nbytes, 1), granularity.value)
        ptr = ctypes.c_uint64()
        _cu("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0),
            ctypes.c_uint64(0), ctypes.c_uint64(0))
        self.ptr = ptr.value
        self._handle: int | None = None
        self._reserved = True
        self._map()
        with torch.cuda.device(self.device):
            self.buffer = torch.as_tensor(_CudaArray(self.ptr, self.nbytes, self), device=self.device)
        self.buffer.zero_()

    def _map(self) -> None:
        handle = ctypes.c_uint64()
        _cu("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(self.nbytes), ctypes.byref(self._prop),
            ctypes.c_uint64(0))
        try:
            _cu("cuMemMap", ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0), handle,
                ctypes.c_uint64(0))
        except RuntimeError:
            _cu("cuMemRelease", handle)
            raise
        self._handle = handle.value
        access = _AccessDesc(_MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, self.device.index),
                             _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        _cu("cuMemSetAccess", ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes), ctypes.byref(access),
            ctypes.c_size_t(1))

    def _unmap(self) -> None:
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)
        _cu("cuMemUnmap", ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes))
        _cu("cuMemRelease", ctypes.c_uint64(self._handle))
        self._handle = None

    def free(self) -> None:
        self._unmap()
        self._host = None
        if self._reserved:
            self._reserved = False
            _cu("cuMemAddressFree", ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes))

    def __del__(self) -> None:  # a region never freed explicitly (an engine left to the collector)
        try:
            self.free()
        except Exception:  # noqa: BLE001 (interpreter teardown: the driver may be gone already)
            pass
