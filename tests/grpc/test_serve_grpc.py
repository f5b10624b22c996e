"""`vllm-vcr serve --grpc`: the VllmEngine service (smg-grpc-proto) through the real process and a
real grpc.aio client, every RPC, as vLLM's gRPC servicer answers them."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

import vllm_vcr

from ..conftest import ServeProcess, async_wait_until, free_port, scaled, subprocess_env, wait_until

DATA = Path(vllm_vcr.__file__).parent / "data"  # the embedded tokenizer (no MODEL argument)
MAX_LEN = 256


def _health_ok(port: int) -> bool:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def start_grpc_serve(tmp_path: Path, *args: str, name: str = "serve") -> ServeProcess:
    proc = ServeProcess(["--grpc", *args], log_path=tmp_path / f"{name}.log")

    def ready() -> bool:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"serve --grpc exited {proc.proc.returncode}:\n{proc.log()}")
        return _health_ok(proc.port)

    try:
        wait_until(ready, 60, "serve --grpc to answer its health check", interval=0.1)
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpc")
    control = free_port()
    kv_port = free_port()
    kv = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}"})
    proc = start_grpc_serve(tmp, "--max-model-len", str(MAX_LEN), "--control-address", f"127.0.0.1:{control}",
                            "--kv-events-config", kv, "--inter-token-latency", "20")
    proc.control = f"http://127.0.0.1:{control}"
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
async def stub(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.VllmEngineStub(channel)


def stats(server) -> dict:
    return httpx.get(server.control + "/stats", timeout=10).json()


def gen(rid: str, ids: list[int], *, stream: bool = False, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
                              sampling_params=pb.SamplingParams(**sampling))


async def collect(call) -> list:
    return [r async for r in call]


# -- info and health ------------------------------------------------------------------------------
async def test_health_model_server_info_and_loads(stub, server):
    health = await stub.HealthCheck(pb.HealthCheckRequest())
    assert health.healthy and health.message == "Health"
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    tok = json.loads((DATA / "tokenizer.json").read_text())
    assert info.is_generation and info.max_context_length == MAX_LEN and info.max_req_input_len == MAX_LEN
    assert info.vocab_size >= len(tok["model"]["vocab"]) and info.served_model_name
    assert list(info.eos_token_ids) and not info.supports_vision
    sinfo = await stub.GetServerInfo(pb.GetServerInfoRequest())
    assert sinfo.server_type == "vllm-grpc" and sinfo.data_parallel_size == 1 and sinfo.max_num_seqs > 0
    assert sinfo.block_size == 16 and sinfo.uptime_seconds > 0
    loads = await stub.GetLoads(pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.version
    (load,) = loads.loads
    assert load.dp_rank == 0 and load.max_running_requests == sinfo.max_num_seqs
    assert load.max_total_num_tokens > 0 and 0.0 <= load.token_usage < 1.0


async def test_standard_health_service(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "vllm.grpc.engine.VllmEngine"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await health.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_loads_count_a_running_request(stub, server):
    call = stub.Generate(gen("loaded", [5] * 20, stream=True, max_tokens=200, ignore_eos=True))
    it = call.__aiter__()
    await it.__anext__()  # running now
    loads = await stub.GetLoads(pb.GetLoadsRequest())
    assert loads.loads[0].num_running_reqs == 1 and loads.loads[0].token_usage > 0
    info = await stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.active_requests == 1
    call.cancel()


# -- Generate -------------------------------------------------------------------------------------
async def test_generate_stream_chunks_add_up_to_the_tokens(stub):
    replies = await collect(stub.Generate(gen("s1", [1, 2, 3, 4, 5], stream=True, max_tokens=8, ignore_eos=True)))
    chunks = [r.chunk for r in replies if r.HasField("chunk")]
    completes = [r.complete for r in replies if r.HasField("complete")]
    assert len(completes) == 1 and replies[-1].HasField("complete")
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 8 and all(c.prompt_tokens == 5 and c.completion_tokens == len(c.token_ids) for c in chunks)
    done = completes[0]
    # the complete repeats the last delta, as vLLM's DELTA output does
    assert list(done.output_ids) == list(chunks[-1].token_ids) and done.finish_reason == "length"
    assert done.prompt_tokens == 5 and done.index == 0


async def test_generate_non_streaming_n2_and_text_input(stub):
    replies = await collect(stub.Generate(pb.GenerateRequest(
        request_id="n2", text="hello world", sampling_params=pb.SamplingParams(max_tokens=6, n=2, ignore_eos=True))))
    assert all(r.HasField("complete") for r in replies)
    assert sorted(r.complete.index for r in replies) == [0, 1]
    for r in replies:
        assert len(r.complete.output_ids) == 6 == r.complete.completion_tokens
        assert r.complete.finish_reason == "length" and r.complete.prompt_tokens >= 2


async def test_generate_prefix_cache_hit_reports_cached_tokens(stub):
    prompt = list(range(100, 150))
    await collect(stub.Generate(gen("c1", prompt, max_tokens=2, ignore_eos=True)))
    (second,) = await collect(stub.Generate(gen("c2", prompt, max_tokens=2, ignore_eos=True)))
    assert second.complete.cached_tokens == 48  # three full 16-token blocks


@pytest.mark.parametrize("request_, message", [
    (gen("bad1", [1, 2], top_p=3.0), "top_p must be in (0, 1]"),
    (gen("bad2", [1, 2], temperature=-1.0), "temperature must be non-negative"),
    (gen("bad3", [1] * (MAX_LEN + 1), max_tokens=1), "maximum context length"),
    (gen("bad4", [10 ** 6]), "out of vocabulary"),
    (pb.GenerateRequest(request_id="bad5"), "requires tokenized or text input"),
    (gen("bad6", [1, 2], presence_penalty=5.0), "presence_penalty must be in [-2, 2]"),
])
async def test_generate_bad_input_is_invalid_argument(stub, server, request_, message):
    before = stats(server)["requests_received"]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await collect(stub.Generate(request_))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()
    assert stats(server)["requests_received"] == before  # refused before the engine


async def test_abort_mid_stream_ends_aborted(stub, server):
    before = stats(server)["requests_aborted"]
    call = stub.Generate(gen("ab1", [7] * 10, stream=True, max_tokens=200, ignore_eos=True))
    replies = []
    async for r in call:
        replies.append(r)
        if len(replies) == 2:
            await stub.Abort(pb.AbortRequest(request_ids=["ab1", "not-running"]))
    assert replies[-1].HasField("complete") and replies[-1].complete.finish_reason == "abort"
    assert sum(len(r.chunk.token_ids) for r in replies if r.HasField("chunk")) < 200
    assert await call.code() == grpc.StatusCode.OK
    await async_wait_until(lambda: stats(server)["requests_aborted"] == before + 1, 10, "the abort in /stats")


async def test_client_cancel_aborts_the_engine_request(stub, server):
    before = stats(server)["requests_aborted"]
    call = stub.Generate(gen("cx", [8] * 10, stream=True, max_tokens=200, ignore_eos=True))
    it = call.__aiter__()
    await it.__anext__()
    call.cancel()
    await async_wait_until(lambda: stats(server)["requests_aborted"] == before + 1, 10, "the cancel in /stats")
    s = stats(server)
    assert s["running"] == 0 and s["waiting"] == 0


# -- tokenizer, KV events, admin ------------------------------------------------------------------
async def test_get_tokenizer_streams_the_bundle(stub):
    chunks = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
    data = b"".join(c.data for c in chunks)
    assert all(not c.sha256 for c in chunks[:-1]) and chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(len(c.data) <= 64 * 1024 for c in chunks)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.read("tokenizer.json") == (DATA / "tokenizer.json").read_bytes()


async def test_subscribe_kv_events_relays_stored_blocks(stub):
    sub = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    prompt = list(range(300, 340))

    async def first_store():
        async for batch in sub:
            for event in batch.events:
                if event.HasField("stored") and list(event.stored.blocks[0].token_ids) == prompt[:16]:
                    return batch, event.stored

    async def generate_until_seen(task):
        while not task.done():  # the subscription is live once a batch arrives; repeat until then
            await stub.FlushCache(common_pb2.FlushCacheRequest())
            await collect(stub.Generate(gen(f"kv{id(task)}", prompt, max_tokens=1, ignore_eos=True)))
            await asyncio.wait([task], timeout=0.5)

    task = asyncio.ensure_future(first_store())
    await asyncio.wait_for(generate_until_seen(task), scaled(30))
    batch, stored = task.result()
    sub.cancel()
    assert batch.dp_rank == 0 and batch.sequence_number >= 0
    assert [list(b.token_ids) for b in stored.blocks[:2]] == [prompt[:16], prompt[16:32]]
    assert all(b.block_size == 16 for b in stored.blocks) and stored.medium == "GPU"
    assert stored.tier == common_pb2.KV_CACHE_TIER_DEVICE
    assert len({b.block_hash for b in stored.blocks}) == len(stored.blocks)


async def test_flush_cache_and_its_bad_timeout(stub):
    ok = await stub.FlushCache(common_pb2.FlushCacheRequest())
    assert ok.success and ok.message == "Local KV prefix cache flushed successfully"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_profile_calls(stub):
    started = await stub.StartProfile(common_pb2.StartProfileRequest())
    assert started.success and started.message == "Start profiling succeeded"
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await stub.StartProfile(common_pb2.StartProfileRequest())
    assert again.value.code() == grpc.StatusCode.INTERNAL and "already active" in again.value.details()
    stopped = await stub.StopProfile(common_pb2.StopProfileRequest())
    assert stopped.success and stopped.message == "Stop profiling succeeded"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.StartProfile(common_pb2.StartProfileRequest(output_dir="/tmp/x", num_steps=3))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output_dir, num_steps cannot be set per request" in e.value.details()


async def test_embed_on_a_generation_model_is_invalid_argument(stub):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Embed(pb.EmbedRequest(request_id="e0", tokenized=pb.TokenizedInput(input_ids=[1, 2])))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- separate processes ---------------------------------------------------------------------------
def test_embed_with_the_pooling_runner(tmp_path):
    proc = start_grpc_serve(tmp_path, "--runner", "pooling", name="pooling")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{proc.port}") as ch:
            stub = pb_grpc.VllmEngineStub(ch)
            a = stub.Embed(pb.EmbedRequest(request_id="e1", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7])))
            b = stub.Embed(pb.EmbedRequest(request_id="e2", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7])))
            assert a.prompt_tokens == 3 and a.embedding_dim == len(a.embedding) > 0
            assert list(a.embedding) == list(b.embedding)
            assert abs(sum(x * x for x in a.embedding) - 1.0) < 1e-3  # normalized, as /v1/embeddings
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            assert not info.is_generation
            with pytest.raises(grpc.RpcError) as e:
                stub.Embed(pb.EmbedRequest(request_id="e3"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        assert proc.stop() == 0


def test_kv_events_off_is_unimplemented(tmp_path):
    proc = start_grpc_serve(tmp_path, name="nokv")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{proc.port}") as ch:
            stub = pb_grpc.VllmEngineStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                next(iter(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())))
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "--kv-events-config" in e.value.details()
    finally:
        assert proc.stop() == 0


def test_port_in_use_is_one_line_naming_the_flag(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--grpc", "--host", "127.0.0.1",
                              "--port", str(port)], capture_output=True, text=True, env=subprocess_env(),
                             timeout=scaled(60))
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "--port" in last and "error" in last


async def test_generate_with_a_choice_constraint(stub):
    # the tokens spell one of the choices (then EOS), as vLLM's structured outputs would
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DATA / "tokenizer.json"))
    choices = ["alpha", "beta gamma"]
    sp = pb.SamplingParams(max_tokens=20, choice=pb.ChoiceConstraint(choices=choices))
    (reply,) = await collect(stub.Generate(pb.GenerateRequest(request_id="ch", text="pick", sampling_params=sp)))
    done = reply.complete
    eos = (await stub.GetModelInfo(pb.GetModelInfoRequest())).eos_token_ids[0]
    # EOS ends it: finish_reason stop, no matched stop (vLLM's stop_reason is None for EOS)
    assert done.finish_reason == "stop" and done.WhichOneof("matched_stop") is None
    assert done.output_ids[-1] == eos and tok.decode(list(done.output_ids)[:-1]) in choices


async def test_generate_with_a_bad_json_schema_is_invalid_argument(stub):
    sp = pb.SamplingParams(max_tokens=5, json_schema="{not json")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await collect(stub.Generate(pb.GenerateRequest(request_id="js", text="x", sampling_params=sp)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_image_health_check_of_a_grpc_server(server):
    from vllm_vcr.deploy import healthcheck

    assert healthcheck.serve_transport(["vllm-vcr", "serve", "--grpc", "--port=9"], {}) == ("grpc", "9")
    assert healthcheck.main(["serve"], words=["vllm-vcr", "serve", "--grpc", "--port", str(server.port)]) == 0
    assert healthcheck.main(["serve"], words=["vllm-vcr", "serve", "--grpc", "--port", str(free_port())]) == 1


async def test_generate_stop_token_id(stub):
    # every token id is a stop token: the first generated one ends the request, as matched_token_id
    vocab = (await stub.GetModelInfo(pb.GetModelInfoRequest())).vocab_size
    (reply,) = await collect(stub.Generate(gen("st", [1, 2], max_tokens=5, stop_token_ids=list(range(vocab)))))
    done = reply.complete
    assert done.finish_reason == "stop" and done.WhichOneof("matched_stop") == "matched_token_id"
    assert list(done.output_ids) == [done.matched_token_id]
