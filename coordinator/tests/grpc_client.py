"""A gRPC client of tandem's frontend as a user would write one in Python.

It finds the services by server reflection (grpcio-reflection), generates its
stubs from the descriptors the server gave (grpcio-tools' protoc with
--descriptor_set_in: no .proto file of ours is read), and calls every RPC:
Frontend.Generate (text, chat and token ids; an idempotency key replayed and
reused; tenant caps and rates; errors with their google.rpc.Status details;
a deadline), Frontend.ListModels, Health.Check and Health.Watch, reflection
itself, and a method the server lacks. Every call after the first runs on one
channel for longer than the server's max connection age, so the server's
GOAWAY must cost no call.

Usage: grpc_client.py ADDR MODEL KEY_OPEN KEY_CAPPED KEY_SLOW OUT_DIR MIN_SECONDS

Prints one JSON object of what it did; exits non-zero (an AssertionError naming
the case) on the first thing that is not as documented.
"""

import importlib
import json
import os
import subprocess
import sys
import time

import grpc
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status

FRONTEND = "tandem.frontend.v1.Frontend"
HEALTH = "grpc.health.v1.Health"


def descriptors(db, symbols):
    """The FileDescriptorSet of the files defining `symbols`, with their imports."""
    files, todo = {}, [db.FindFileContainingSymbol(s) for s in symbols]
    while todo:
        f = todo.pop()
        if f.name in files:
            continue
        files[f.name] = f
        todo.extend(db.FindFileByName(d) for d in f.dependency)
    out = descriptor_pb2.FileDescriptorSet()
    out.file.extend(files.values())
    return out


def stubs(channel, out_dir):
    """Generates and imports the stubs of the services reflection lists."""
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {FRONTEND, HEALTH} <= services, f"reflection lists {services}"
    wanted = descriptors(db, [FRONTEND, HEALTH])
    path = os.path.join(out_dir, "reflected.binpb")
    with open(path, "wb") as f:
        f.write(wanted.SerializeToString())
    names = [f.name for f in wanted.file]
    args = [sys.executable, "-m", "grpc_tools.protoc", f"--descriptor_set_in={path}",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *names]
    subprocess.run(args, check=True)
    sys.path.insert(0, out_dir)
    modules = {}
    for name in names:
        base = name[:-len(".proto")].replace("/", ".")
        modules[name] = (importlib.import_module(base + "_pb2"), importlib.import_module(base + "_pb2_grpc"))
    frontend = next(m for n, m in modules.items() if "frontend" in n)
    health = next(m for n, m in modules.items() if "health" in n)
    return frontend, health, sorted(services)


def details(err):
    """The google.rpc details of a failed call: (ErrorInfo, RetryInfo, [bad fields])."""
    status = rpc_status.from_call(err)
    assert status is not None, f"{err.code()} carries no google.rpc.Status: {err.details()}"
    assert status.code == err.code().value[0], (status.code, err.code())
    info, retry, fields = None, None, []
    for d in status.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
        elif d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            d.Unpack(retry)
        elif d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            d.Unpack(bad)
            fields = [v.field for v in bad.field_violations]
    assert info is not None and info.domain == "tandem", f"no ErrorInfo in {status}"
    return info, retry, fields


def main():
    addr, model, key_open, key_capped, key_slow, out_dir, min_seconds = sys.argv[1:8]
    auth = lambda key: [("authorization", f"Bearer {key}")]  # noqa: E731
    report = {"generate_ok": 0, "refused": {}}

    channel = grpc.insecure_channel(addr)
    started = time.monotonic()
    (pb, pb_grpc), (hpb, hpb_grpc), services = stubs(channel, out_dir)
    report["services"] = services
    frontend = pb_grpc.FrontendStub(channel)
    health = hpb_grpc.HealthStub(channel)

    def generate(key, timeout=60, served=model, **fields):
        call = frontend.Generate(pb.GenerateRequest(model=served, **fields), metadata=auth(key), timeout=timeout)
        text, ids, done = "", [], None
        for event in call:
            if event.HasField("chunk"):
                text += event.chunk.text
                ids.extend(event.chunk.token_ids)
            else:
                done = event.done
        seed = dict(call.initial_metadata()).get("x-tandem-seed")
        assert done is not None and done.finish_reason in (1, 2), f"no Done: {fields}"
        assert seed is not None and int(seed) == done.seed, (seed, done.seed)
        report["generate_ok"] += 1
        return text, ids, done

    def refused(code, reason, what, **kw):
        try:
            kw.setdefault("key", key_open)
            generate(**kw)
        except grpc.RpcError as e:
            assert e.code() == code, f"{what}: {e.code()} {e.details()}, wanted {code}"
            info, retry, fields = details(e)
            assert info.reason == reason, f"{what}: ErrorInfo {info.reason}, wanted {reason}"
            assert info.metadata["code"] == reason.lower(), f"{what}: {dict(info.metadata)}"
            report["refused"][reason] = report["refused"].get(reason, 0) + 1
            return retry, fields
        raise AssertionError(f"{what}: answered; wanted {code}")

    # Health and models.
    # Health: watched until SERVING (it is re-checked every second), then checked.
    serving = hpb.HealthCheckResponse.ServingStatus.Value("SERVING")
    watch = health.Watch(hpb.HealthCheckRequest(service=FRONTEND), timeout=60)
    assert any(r.status == serving for r in watch), "the health watch ended before SERVING"
    watch.cancel()
    assert health.Check(hpb.HealthCheckRequest(service="")).status == serving
    models = frontend.ListModels(pb.ListModelsRequest(), metadata=auth(key_open)).models
    assert [m.id for m in models] == [model], models
    try:
        frontend.ListModels(pb.ListModelsRequest())
        raise AssertionError("ListModels without a key was answered")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.code()
        assert details(e)[0].reason == "INVALID_API_KEY"

    # Generate: every input form.
    text, ids, _ = generate(key_open, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert text and len(ids) <= 6, (text, ids)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Say hi")])
    generate(key_open, messages=chat, max_tokens=4, temperature=0)
    generate(key_open, token_ids=pb.TokenIds(ids=[504, 3458, 282, 4649]), max_tokens=4, temperature=0)

    # Idempotency: a retry with the key gets the first answer, token for token, even
    # sampled; the key with another request is refused.
    sampled = dict(prompt="Once upon a time", max_tokens=8, temperature=1.0, idempotency_key="py-key-1")
    first = generate(key_open, **sampled)
    again = generate(key_open, **sampled)
    assert first[1] == again[1] and first[2].seed == again[2].seed, (first, again)
    refused(grpc.StatusCode.INVALID_ARGUMENT, "IDEMPOTENCY_KEY_REUSED", "a reused key",
            prompt="Another", max_tokens=8, idempotency_key="py-key-1")

    # Errors, with their google.rpc details.
    _, fields = refused(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_VALUE", "temperature 5",
                        prompt="x", temperature=5.0)
    assert fields == ["temperature"], fields
    refused(grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", "an unknown model", prompt="x", served="gpt-9")
    refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "REQUEST_TOO_LARGE", "a message over the cap",
            prompt="x" * 70_000, max_tokens=1)
    _, fields = refused(grpc.StatusCode.INVALID_ARGUMENT, "MAX_TOKENS_TOO_LARGE", "over the tenant's max_tokens",
                        key=key_capped, prompt="x", max_tokens=64)
    assert fields == ["max_tokens"], fields
    # The slow tenant: one request per 5 s and a burst of two (the coordinator's least);
    # the third at once is over its rate.
    generate(key_slow, prompt="x", max_tokens=1)
    generate(key_slow, prompt="x", max_tokens=1)
    retry, _ = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMIT_REQUESTS", "over the tenant's rate",
                       key=key_slow, prompt="x", max_tokens=1, idempotency_key="slow-1")
    assert retry is not None and retry.retry_delay.seconds >= 1, retry
    # Sent again at once, before its RetryInfo is up: not served, and told no later a time
    # (the tenant's bucket, checked first, refuses it as the gate would).
    again, _ = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMIT_REQUESTS", "a retry before its RetryInfo",
                       key=key_slow, prompt="x", max_tokens=1, idempotency_key="slow-1")
    assert 1 <= again.retry_delay.seconds <= retry.retry_delay.seconds, (again, retry)
    # A deadline the answer cannot meet: a long prompt's first token takes longer than 50 ms.
    try:
        generate(key_open, timeout=0.05, prompt="the cat sat on the mat " * 300, max_tokens=200, ignore_eos=True)
        raise AssertionError("a 50 ms deadline was met by 200 tokens")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.code()
    # A method the server does not have.
    try:
        channel.unary_unary("/tandem.frontend.v1.Frontend/NoSuchMethod")(b"", timeout=10)
        raise AssertionError("an unknown method was answered")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNIMPLEMENTED, e.code()

    # Keep calling on this one channel past the server's max connection age: its
    # GOAWAY moves the channel to a new connection without failing a call.
    while time.monotonic() - started < float(min_seconds):
        generate(key_open, prompt="Hello", max_tokens=2, temperature=0)
    report["seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
