"""Which sides of a diff report MoE routes, and `--fix-routes`: checked before anything runs.

An engine side of a MoE model runs with enable_return_routed_experts (unless its SPEC turns it off), an `hf` side
reads its router logits, a `file` side its records' `routed_experts`. `--fix-routes a` replays side A's routes on
side B (SamplingParams.trace_routed_experts), `b` the other way, so the diff shows the numerical mismatch alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .routes import record_routes
from .sides import DiffRequest, SideScores
from .spec import ENGINE, FILE, HF, SideSpec, SpecError
from .trace_file import TraceFileError

FIX_SIDES = ("a", "b")
ROUTES_OPTION = "enable_return_routed_experts"


@dataclass(frozen=True)
class SideRoutes:
    """Whether one side reports routes: (num_layers, top_k) when it does, else why not."""

    shape: tuple[int, int] | None
    why_not: str | None = None
    moe_model: bool = False  # the side runs a MoE model (engine / hf)


@dataclass(frozen=True)
class RoutePlan:
    sides: tuple[SideSpec, SideSpec]  # engine sides of a MoE model with enable_return_routed_experts on
    routes: tuple[SideRoutes, SideRoutes]
    fix: str | None = None  # "a" | "b": that side's routes are forced on the other one

    @property
    def reported(self) -> bool:
        """A routing section belongs in the report: a side runs a MoE model or reports routes."""
        return any(r.moe_model or r.shape is not None for r in self.routes)

    @property
    def comparable(self) -> str | None:
        """None when both sides report routes of one shape, else the reason they cannot be compared."""
        for name, spec, r in zip("AB", self.sides, self.routes):
            if r.shape is None:
                return f"side {name} ({spec.text!r}) reports no routes: {r.why_not}"
        (la, ka), (lb, kb) = self.routes[0].shape, self.routes[1].shape
        if (la, ka) != (lb, kb):
            return f"the sides route differently shaped models ({la} layers, top-{ka} vs {lb} layers, top-{kb})"
        return None

    @property
    def first(self) -> int:
        """The side that runs first (0: A): the source of fixed routes must have run before the forced side."""
        return 1 if self.fix == "b" else 0

    def forced(self, requests: list[DiffRequest], source: Sequence[SideScores]) -> list[DiffRequest]:
        """The requests the second side replays: with --fix-routes, each carrying the source side's routes."""
        if self.fix is None:
            return requests
        return [replace(r, forced_routes=s.routes) for r, s in zip(requests, source)]


def plan_routes(sides: tuple[SideSpec, SideSpec], requests: list[DiffRequest], model: str | None,
                fix_routes: str | None = None, localize: int = 0) -> RoutePlan:
    """Decide what each side reports and check --fix-routes. Raises SpecError (a ValueError) for --fix-routes on
    a dense model, from a side without routes, onto an `hf` or `file` side, or with --localize; TraceFileError for
    stored routes that do not fit their request."""
    if fix_routes is not None and fix_routes not in FIX_SIDES:
        raise SpecError(f"--fix-routes must be 'a' or 'b' (the side whose routes are replayed on the other), got "
                        f"{fix_routes!r}")
    sides = tuple(_with_routes(s, model) for s in sides)
    routes = tuple(_side_routes(s, requests, model) for s in sides)
    if any(s.kind == FILE and r.shape is not None for s, r in zip(sides, routes)):
        _check_file_routes(requests, sides, model)
    plan = RoutePlan(sides, routes, fix_routes)
    if fix_routes is not None:
        _check_fix(plan, localize)
    return plan


def _check_fix(plan: RoutePlan, localize: int) -> None:
    src = FIX_SIDES.index(plan.fix)
    dst = 1 - src
    what = f"--fix-routes {plan.fix}"
    if not any(r.moe_model for r in plan.routes):
        raise SpecError(f"{what}: the model is dense (not a mixture of experts): there are no routes to fix")
    names, specs = "AB", plan.sides
    if plan.routes[src].shape is None:
        raise SpecError(f"{what}: side {names[src]} ({specs[src].text!r}) has no routes to replay: "
                        f"{plan.routes[src].why_not}")
    target = specs[dst]
    where = f"{what}: side {names[dst]} ({target.text!r})"
    if target.kind == HF:
        raise SpecError(f"{where} is transformers' forward, which cannot be given routes; replay its routes on "
                        f"the engine side instead (--fix-routes {FIX_SIDES[dst]})")
    if target.kind == FILE:
        raise SpecError(f"{where} reads stored logprobs; only an engine side can replay routes")
    if plan.routes[dst].shape is None:
        raise SpecError(f"{where} reports no routes: {plan.routes[dst].why_not}")
    reason = plan.comparable
    if reason is not None:
        raise SpecError(f"{what}: {reason}")
    if localize:
        raise SpecError(f"{what} cannot be combined with --localize (its replay would route freely)")


def _model_config(spec: SideSpec, model: str | None):
    from replayllm.config import ModelConfig
    from replayllm.embedded_model import DEFAULT_MODEL

    return ModelConfig.from_pretrained(spec.options.get("model") or model or DEFAULT_MODEL)


def _with_routes(spec: SideSpec, model: str | None) -> SideSpec:
    """An engine side of a MoE model with enable_return_routed_experts on (unless its SPEC sets it)."""
    if spec.kind != ENGINE or ROUTES_OPTION in spec.options:
        return spec
    try:
        moe = _model_config(spec, model).is_moe
    except (OSError, ValueError):
        return spec  # a bad model: _check_side names the side and the problem
    return SideSpec(spec.kind, {ROUTES_OPTION: True, **spec.options}, spec.text) if moe else spec


def _side_routes(spec: SideSpec, requests: list[DiffRequest], model: str | None) -> SideRoutes:
    if spec.kind == FILE:
        return _file_routes(requests)
    try:
        mc = _model_config(spec, model)
    except (OSError, ValueError):
        return SideRoutes(None, "its model could not be read")  # _check_side reports it
    if not mc.is_moe:
        return SideRoutes(None, "its model is dense")
    if spec.kind == ENGINE and not spec.options.get(ROUTES_OPTION):
        return SideRoutes(None, f"its SPEC sets {ROUTES_OPTION}=false", moe_model=True)
    return SideRoutes((mc.num_layers, mc.num_experts_per_tok), moe_model=True)


def _file_routes(requests: list[DiffRequest]) -> SideRoutes:
    """A trace file reports routes when every request stores `routed_experts` of one shape, one row per routed
    position of its (resolved) prompt + trace."""
    shape = None
    for r in requests:
        routes = record_routes(r.record.routed_experts)
        if routes is None:
            return SideRoutes(None, f"{r.record.where} stores no 'routed_experts'")
        rows = len(r.prompt_token_ids) + len(r.trace_token_ids) - 1
        if routes.shape[0] != rows:
            raise TraceFileError(f"{r.record.where}: 'routed_experts' holds {routes.shape[0]} rows; its prompt + "
                                 f"trace route {rows} positions (len(prompt) + len(trace) - 1)")
        if shape is not None and routes.shape[1:] != shape:
            raise TraceFileError(f"{r.record.where}: 'routed_experts' rows are [{routes.shape[1]}][{routes.shape[2]}]"
                                 f" (layers, top_k); earlier requests' are [{shape[0]}][{shape[1]}]")
        shape = routes.shape[1:]
    return SideRoutes((int(shape[0]), int(shape[1])))


def _check_file_routes(requests: list[DiffRequest], sides: tuple[SideSpec, SideSpec], model: str | None) -> None:
    """A file side's stored routes against the model of the diff (an engine / hf side's, else MODEL's): its layer
    count and top_k, ids in [0, num_experts) on its sparse layers and -1 on its dense ones (the engine's layout).
    TraceFileError naming the record, before any side runs; nothing checked when no model config can be read (a
    side's own check names that) or the model is dense (_check_fix / the report say so)."""
    import numpy as np

    spec = next((s for s in sides if s.kind != FILE), sides[0])
    try:
        mc = _model_config(spec, model)
    except (OSError, ValueError):
        return
    if not mc.is_moe:
        return
    sparse = np.zeros(mc.num_layers, dtype=bool)
    sparse[list(mc.moe_layers)] = True
    for r in requests:
        routes = record_routes(r.record.routed_experts)  # [positions, layers, top_k]
        where = f"{r.record.where}: 'routed_experts'"
        if routes.shape[1:] != (mc.num_layers, mc.num_experts_per_tok):
            raise TraceFileError(f"{where} rows are [{routes.shape[1]}][{routes.shape[2]}] (layers, top_k); the "
                                 f"model has {mc.num_layers} layers, top_k {mc.num_experts_per_tok}")
        chosen = routes[:, sparse]
        if ((chosen < 0) | (chosen >= mc.num_experts)).any():
            raise TraceFileError(f"{where} names an expert outside [0, {mc.num_experts}) on a sparse layer "
                                 f"(e.g. {int(chosen[(chosen < 0) | (chosen >= mc.num_experts)][0])})")
        dense = routes[:, ~sparse]
        if (dense != -1).any():
            layer = int(np.nonzero((dense != -1).any(axis=(0, 2)))[0][0])
            raise TraceFileError(f"{where} routes the dense layer {np.nonzero(~sparse)[0][layer]} (the engine "
                                 f"stores -1 there)")
