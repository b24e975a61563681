"""The API server's side of the engine core's messages (no core process): ClientOutputRouter (detokenizing,
stop strings, fast-replay rows, steps that queued up routed in one pass) and EngineCoreClient's output reader."""

from __future__ import annotations

import asyncio
import time

from replayllm import SamplingParams


class _FakeClient:
    """What ClientOutputRouter uses of EngineCoreClient: stats, snapshot, utility answers, core aborts."""

    def __init__(self):
        from replayllm.engine.engine_stats import StatsSink

        self.stats, self.snapshot, self.core_aborts = StatsSink(), None, []

    def resolve_call(self, call_id, ok, result):
        raise AssertionError("no utility call was made")

    def send_abort(self, ids):
        self.core_aborts.extend(ids)

    def abort(self, ids):  # RequestStream's engine
        pass


def test_router_detokenizes_cuts_at_stop_strings_and_aborts_in_the_core():
    """The API-server side of the core's messages, no process: text, stop strings (an abort goes to the core),
    logprobs from the flat arrays, FINAL_ONLY, and tokens the core sends after a stop here are dropped."""
    from replayllm.config import EngineConfig
    from replayllm.engine.client_outputs import ClientOutputRouter
    from replayllm.engine.core_messages import ENCODER, OUTPUTS_DECODER, CoreOutputs
    from replayllm.engine.input_processor import InputProcessor
    from replayllm.engine.request_stream import RequestStream, Tracked
    from replayllm.sampling_params import RequestOutputKind

    inputs = InputProcessor(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512))
    tok = inputs.tokenizer
    ids = tok.encode(" there lived a curious little robot.", add_special_tokens=False)
    fake = _FakeClient()
    router = ClientOutputRouter(inputs, fake)

    async def main():
        loop = asyncio.get_running_loop()
        streams = {}
        for rid, params in (("s", SamplingParams(max_tokens=50, stop=["curious"], logprobs=1)),
                            ("f", SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.FINAL_ONLY))):
            streams[rid] = RequestStream(fake, [rid], loop)
            router.add(rid, inputs.prepare_request({"prompt_token_ids": [1, 2, 3]}, params),
                       Tracked(streams[rid], 0, 1, time.monotonic()))
        for step, t in enumerate(ids):
            last = step == len(ids) - 1
            msg = CoreOutputs(req_ids=["s", "f"], token_ids=[t, t], num_cached_tokens=[0, 0],
                              logprob=[-0.25 * step, -1.0], rank=[step + 1, 1], topk_ids=[[7], [7]],
                              topk_logprobs=[[-0.125], [-0.125]], finished=[("f", "length", None)] if last else [],
                              step_started=time.monotonic(), step_ended=time.monotonic(), num_step_reqs=2,
                              num_step_tokens=2)
            router.apply(OUTPUTS_DECODER.decode(ENCODER.encode(msg)))  # through the wire format
        return ([out async for _, out in streams["s"].outputs()], [out async for _, out in streams["f"].outputs()])

    stopped, final = asyncio.run(main())
    comp = stopped[-1].outputs[0]
    assert stopped[-1].finished and comp.finish_reason == "stop" and comp.stop_reason == "curious"
    assert comp.text == " there lived a "
    n = len(comp.token_ids)
    assert comp.token_ids == ids[:n] and "curious" in tok.decode(ids[:n]) and "curious" not in tok.decode(ids[:n - 1])
    assert [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)] == [-0.25 * i for i in range(n)]
    assert [lp[t].rank for lp, t in zip(comp.logprobs, comp.token_ids)] == list(range(1, n + 1))
    assert fake.core_aborts == ["s"]  # the core still ran it: aborted there once, later tokens dropped here
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == tok.decode(ids)
    assert final[0].outputs[0].finish_reason == "length" and not router.tracked and not router.processor.parents


def test_router_takes_a_fast_replay_chunk_as_consecutive_rows():
    """A fast-replay row that sampled n tokens comes as n consecutive wire rows of one request: all n tokens
    with their own logprobs, and the finish (sent for the request) applies after its last row only."""
    from replayllm.config import EngineConfig
    from replayllm.engine.client_outputs import ClientOutputRouter
    from replayllm.engine.core_messages import ENCODER, OUTPUTS_DECODER, CoreOutputs
    from replayllm.engine.input_processor import InputProcessor
    from replayllm.engine.request_stream import RequestStream, Tracked

    inputs = InputProcessor(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512,
                                         enable_trace_replay=True))
    fake = _FakeClient()
    router = ClientOutputRouter(inputs, fake)
    trace = [11, 12, 13, 14, 15]

    async def main():
        stream = RequestStream(fake, ["t"], asyncio.get_running_loop())
        params = SamplingParams(trace_decode_token_ids=trace, logprobs=1, trace_replay_chunk_size=4)
        router.add("t", inputs.prepare_request({"prompt_token_ids": [1, 2, 3]}, params),
                   Tracked(stream, 0, 1, time.monotonic()))
        for chunk, finished in ((trace[:1], []), (trace[1:], [("t", "length", None)])):  # prefill, then 4 rows
            msg = CoreOutputs(req_ids=["t"] * len(chunk), token_ids=chunk, num_cached_tokens=[0] * len(chunk),
                              logprob=[-t / 10 for t in chunk], rank=[t for t in chunk],
                              topk_ids=[[7]] * len(chunk), topk_logprobs=[[-0.5]] * len(chunk), finished=finished,
                              step_started=time.monotonic(), step_ended=time.monotonic(), num_step_reqs=1,
                              num_step_tokens=len(chunk))
            router.apply(OUTPUTS_DECODER.decode(ENCODER.encode(msg)))
        return [out async for _, out in stream.outputs()]

    outs = asyncio.run(main())
    comp = outs[-1].outputs[0]
    assert outs[-1].finished and comp.finish_reason == "length" and comp.token_ids == trace
    assert [lp[t].logprob for lp, t in zip(comp.logprobs, trace)] == [-t / 10 for t in trace]
    assert [lp[t].rank for lp, t in zip(comp.logprobs, trace)] == trace
    assert not router.tracked and not fake.core_aborts


def test_router_coalesces_queued_steps_into_one_delivery_per_request():
    """Steps that queued while the API process was busy (apply_many): each request gets one output carrying every
    step's tokens, the same text and tokens as step-by-step routing; a request that a later message's step error
    ended gets only that error (the tokens routed before it in the same batch are not delivered after it)."""
    from replayllm.config import EngineConfig
    from replayllm.engine.client_outputs import ClientOutputRouter
    from replayllm.engine.core_messages import CoreOutputs
    from replayllm.engine.input_processor import InputProcessor
    from replayllm.engine.request_stream import EngineStepError, RequestStream, Tracked

    inputs = InputProcessor(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512))
    ids = inputs.tokenizer.encode(" a robot walked home slowly", add_special_tokens=False)

    def step(rids, t, finished=(), error=None):
        now = time.monotonic()
        return CoreOutputs(req_ids=list(rids), token_ids=[t] * len(rids), num_cached_tokens=[0] * len(rids),
                           finished=list(finished), step_started=now, step_ended=now, num_step_reqs=len(rids),
                           num_step_tokens=len(rids), step_error=error, failed=["a"] if error else [])

    def run(batches):
        """Route `batches` (lists of messages, one apply_many each); per request: deliveries and outputs read."""
        fake = _FakeClient()
        router = ClientOutputRouter(inputs, fake)

        async def main():
            loop, streams, counts = asyncio.get_running_loop(), {}, {}
            for rid in ("a", "b"):
                streams[rid] = stream = RequestStream(fake, [rid], loop)
                counts[rid] = 0

                def deliver(index, item, _deliver=stream.deliver, rid=rid):
                    counts[rid] += 1
                    _deliver(index, item)

                stream.deliver = deliver
                router.add(rid, inputs.prepare_request({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=64)),
                           Tracked(stream, 0, 1, time.monotonic()))
            for batch in batches:
                router.apply_many(batch)
            outs = {}
            for rid, stream in streams.items():
                try:
                    outs[rid] = [out async for _, out in stream.outputs()]
                except EngineStepError as e:
                    outs[rid] = e
            return counts, outs

        return asyncio.run(main())

    msgs = [step("ab", t) for t in ids[:-1]] + [step("ab", ids[-1], [("a", "length", None), ("b", "length", None)])]
    one_by_one = run([[m] for m in msgs])
    together = run([msgs[:3], msgs[3:]])
    assert one_by_one[0] == {"a": len(ids), "b": len(ids)} and together[0] == {"a": 2, "b": 2}
    for rid in "ab":
        final = together[1][rid][-1].outputs[0]
        assert final.token_ids == ids and final.text == one_by_one[1][rid][-1].outputs[0].text
        assert final.text == inputs.tokenizer.decode(ids) and together[1][rid][-1].finished
    failed = run([[step("ab", ids[0]), step("b", ids[1]), step([], 0, error="boom")],
                  [step("b", ids[2], [("b", "length", None)])]])
    assert failed[0]["a"] == 1 and isinstance(failed[1]["a"], EngineStepError)  # the error only
    assert failed[1]["b"][-1].outputs[0].token_ids == ids[:3] and failed[0]["b"] == 2


def test_output_reader_routes_the_steps_that_queued_in_one_call(tmp_path):
    """EngineCoreClient's output reader: the messages already waiting on the socket when it wakes are routed by
    one apply_many call (one delivery per request for all of them); a message arriving alone goes alone."""
    import zmq

    from replayllm.config import EngineConfig
    from replayllm.engine.core_client import EngineCoreClient
    from replayllm.engine.core_messages import ENCODER, CoreOutputs

    client = EngineCoreClient(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512))
    calls = []

    class Recorder:
        def apply_many(self, msgs):
            calls.append([m.num_step_reqs for m in msgs])

    client._router = Recorder()
    path = f"ipc://{tmp_path}/out"

    async def main():
        ctx = zmq.Context()
        client._outputs.bind(ctx, path)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(path)
        try:
            for n in (1, 2, 3):  # three steps queue up before the reader runs
                push.send(ENCODER.encode(CoreOutputs(num_step_reqs=n)))
            deadline = time.monotonic() + 30
            while not client._outputs.socket.poll(0) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # all three delivered to the PULL socket (ipc: microseconds)
            reader = asyncio.create_task(client._outputs.run())
            while not calls and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            push.send(ENCODER.encode(CoreOutputs(num_step_reqs=4)))
            while len(calls) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            reader.cancel()
        finally:
            push.close(linger=0)
            client._outputs.close()
            ctx.term()

    asyncio.run(main())
    assert calls == [[1, 2, 3], [4]]


def test_outputs_queued_during_a_request_intake_are_routed_by_its_hand_off(tmp_path):
    """EngineCoreClient.add_requests routes the outputs already queued from the core before it returns
    (CoreOutputReader.poll: never waits), so a burst of arrivals, which the event loop runs back to back, does not hold
    the running requests' tokens until the burst is over; the reader task routes the rest, all in order."""
    import zmq

    from replayllm.config import EngineConfig
    from replayllm.engine.core_client import EngineCoreClient
    from replayllm.engine.core_messages import ENCODER, CoreOutputs

    client = EngineCoreClient(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512))
    calls, added, sent = [], [], []

    class Recorder:
        def apply_many(self, msgs):
            calls.append([m.num_step_reqs for m in msgs])

        def add(self, rid, prepared, tracked):
            added.append(rid)

    client._router = Recorder()
    client._send = lambda kind, payload: sent.append(kind)
    path = f"ipc://{tmp_path}/out"

    async def main():
        ctx = zmq.Context()
        client._outputs.bind(ctx, path)
        client._loop, client._running = asyncio.get_running_loop(), True
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(path)
        deadline = time.monotonic() + 30
        reader = asyncio.create_task(client._outputs.run())
        try:
            push.send(ENCODER.encode(CoreOutputs(num_step_reqs=1)))
            while not calls and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            for n in (2, 3):
                push.send(ENCODER.encode(CoreOutputs(num_step_reqs=n)))
            # The event loop busy (another request's intake) while they arrive: the reader task cannot run. Block
            # until the first of them is on the socket (a blocking poll: it receives nothing).
            assert client._outputs.socket.poll(30_000), "the messages never arrived"
            await client.add_requests("cmpl-x", [{"prompt_token_ids": [1, 2, 3]}], [SamplingParams(max_tokens=2)])
            # add_requests has no real await on this path (token ids, no bad words): only its own poll routed them
            assert len(calls) == 2 and calls[1][0] == 2 and added == ["cmpl-x-0"] and sent == ["add"]
            client._outputs.poll()  # nothing queued (or message 3 alone, had it come late): never an empty call
            push.send(ENCODER.encode(CoreOutputs(num_step_reqs=4)))
            while sum(map(len, calls)) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            reader.cancel()
            push.close(linger=0)
            client._outputs.close()
            ctx.term()

    asyncio.run(main())
    assert [n for c in calls for n in c] == [1, 2, 3, 4] and all(calls)


def test_a_ready_sink_gets_the_live_output_and_a_declined_one_queues_a_copy():
    """A stream's direct sink renders at once and keeps nothing: the router hands it the request's live state
    (no per-step copy of every token id so far, which made a long stream's cost per token grow with its
    length); when the sink declines (back-pressure) or the reader is not parked, the output queued for the
    reader is a copy that later steps do not change."""
    from replayllm.config import EngineConfig
    from replayllm.engine.client_outputs import ClientOutputRouter
    from replayllm.engine.core_messages import CoreOutputs
    from replayllm.engine.input_processor import InputProcessor
    from replayllm.engine.request_stream import RequestStream, Tracked

    inputs = InputProcessor(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512))
    ids = inputs.tokenizer.encode(" a robot walked home slowly", add_special_tokens=False)
    router = ClientOutputRouter(inputs, _FakeClient())
    seen, accept = [], [True]

    def sink(index, out):
        comp = out.outputs[0]
        seen.append((comp is router.processor.parents["a"].completions[0], list(comp.token_ids), accept[0]))
        return accept[0]

    async def main():
        loop = asyncio.get_running_loop()
        stream = RequestStream(_FakeClient(), ["a"], loop)
        stream.sink = sink
        router.add("a", inputs.prepare_request({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=64)),
                   Tracked(stream, 0, 1, time.monotonic()))
        reader = stream.outputs()
        first = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0)  # the reader parks: the sink is ready
        queued = None
        for k, t in enumerate(ids):
            accept[0] = k != 2  # step 2: the transport is over its high-water mark
            now = time.monotonic()
            router.apply(CoreOutputs(req_ids=["a"], token_ids=[t], num_cached_tokens=[0], step_started=now,
                                     step_ended=now, num_step_reqs=1, num_step_tokens=1))
            if k == 2:
                _, queued = await first  # the declined step's output went to the reader
        return queued

    queued = asyncio.run(main())
    assert [n for _, n, _ in seen] == [ids[:1], ids[:2], ids[:3], ids[:3]]
    live = [(is_live, n) for is_live, n, ok in seen if ok]
    assert live == [(True, ids[:1]), (True, ids[:2])]  # sunk while the reader was parked: the live state
    assert [ok for *_, ok in seen] == [True, True, False, False]  # declined: offered live, then the copy
    assert seen[2][0] and not seen[3][0]
    assert queued.outputs[0].token_ids == ids[:3]  # a copy: the later steps (routed after) did not reach it
    assert len(seen) == 4  # after the decline the stream has a queued output: the reader path, no more sink
