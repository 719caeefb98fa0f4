"""What `python -m fastbert serve --ray` and fastbert.serve.ray.deployment ask Ray Serve for, and the mistakes they
refuse, without a cluster: each refusal is one line (exit 2) or an error naming the value, before any Ray cluster
starts. Then one replica's life in this process, through the steps Ray Serve's replica takes (its constructor, the
app it builds, the app's lifespan under Ray Serve's own ingress code): it starts only once its model is loaded,
fails its health check when its model worker stops, and a model that cannot load fails it with the model's own
error. The deployment itself runs in tests/serve/test_serve_ray.py."""
import argparse
import asyncio
import re
import shutil

import pytest
from helpers import assert_one_line_error, main_in_process, optional

optional("ray.serve", reason="Ray Serve comes with the ray extra: pip install -e '.[test]'")
optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")

import ray  # noqa: E402
from ray.serve.config import AutoscalingConfig  # noqa: E402

from fastbert.cli.common import UsageError  # noqa: E402
from fastbert.cli.serve import replica_plan, serve_parser  # noqa: E402
from fastbert.serve import ray as on_ray  # noqa: E402

BAD_COMMANDS = [
    (["--replicas", "2"], "--replicas is an option of --ray"),
    (["--min-replicas", "1", "--max-replicas", "2"], "--min-replicas is an option of --ray"),
    (["--ray", "--replicas", "2", "--min-replicas", "1", "--max-replicas", "3"], "not both"),
    (["--ray", "--min-replicas", "2"], "autoscaling needs both --min-replicas and --max-replicas"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is more than --max-replicas 2"),
    (["--ray", "--target-ongoing-requests", "8"], "--target-ongoing-requests is for autoscaling"),
    (["--ray", "--device", "cuda:1"], "--device 'cuda:1': with --ray a replica runs on cpu or cuda"),
    (["--ray", "--device", "cpu", "--gpus-per-replica", "1"], "--gpus-per-replica is for --device cuda"),
    (["--ray", "--replicas", "0"], "--replicas: must be >= 1, got 0"),
    (["--ray", "--gpus-per-replica", "0"], "--gpus-per-replica: must be > 0, got 0"),
]


@pytest.mark.parametrize("argv, words", BAD_COMMANDS, ids=[" ".join(a) for a, _ in BAD_COMMANDS])
def test_bad_ray_options_are_one_line_before_any_cluster(capsys, argv, words):
    code, _, err = main_in_process(capsys, "serve", *argv)
    assert_one_line_error(code, err, words)
    assert not ray.is_initialized()


def test_a_bad_folder_is_one_line_before_any_cluster(capsys, tmp_path):
    code, _, err = main_in_process(capsys, "serve", str(tmp_path / "missing"), "--ray")
    assert code == 2 and "missing" in err and len(err.strip().splitlines()) == 1, err
    assert not ray.is_initialized()


def plan(resources, *argv):
    return replica_plan(serve_parser().parse_args(["--ray", *argv]), resources)


def test_replica_plan_one_model_per_gpu_or_per_cpu():
    gpus = {"CPU": 64.0, "GPU": 4.0}
    assert plan(gpus) == (4, 1, 1)                                   # one replica per GPU
    assert plan(gpus, "--gpus-per-replica", "0.5") == (8, 0.5, 1)    # two per GPU
    assert plan(gpus, "--replicas", "2") == (2, 1, 1)
    assert plan(gpus, "--min-replicas", "1", "--max-replicas", "8") == (None, 1, 1)
    assert plan(gpus, "--device", "cpu", "--cpus-per-replica", "16") == (4, 0, 16)   # CPU replicas on a GPU node
    cpus = {"CPU": 2.0}
    assert plan(cpus) == (2, 0, 1)                                   # one per core, one torch thread each
    assert plan(cpus, "--cpus-per-replica", "2") == (1, 0, 2)
    with pytest.raises(UsageError, match="the Ray cluster has no GPU"):
        plan(cpus, "--device", "cuda")


def test_deployment_options_ray_serve_receives():
    """A fixed count: num_replicas; each replica one GPU and one CPU (device cuda), or its CPUs as torch threads on
    CPU; as many requests in flight per replica as the app admits, as many waiting at each proxy, then 429."""
    settings, init = on_ray._settings(replicas=3, min_replicas=None, max_replicas=None, target_ongoing_requests=32,
                                      gpus_per_replica=None, cpus_per_replica=1,
                                      options={"max_concurrent_requests": 64, "dtype": "bfloat16"})
    server = on_ray.Server.options(**settings)  # Ray Serve's own validation of every option
    assert (server.num_replicas, server.max_ongoing_requests, server.max_queued_requests) == (3, 64, 64)
    assert server.ray_actor_options == {"num_cpus": 1, "num_gpus": 1}
    assert server.backpressure_config.status_code == 429
    assert init == {"max_concurrent_requests": 64, "dtype": "bfloat16", "device": "cuda", "threads": None}
    settings, init = on_ray._settings(replicas=None, min_replicas=None, max_replicas=None, target_ongoing_requests=32,
                                      gpus_per_replica=None, cpus_per_replica=2, options={"device": "cpu"})
    server = on_ray.Server.options(**settings)
    assert server.num_replicas == 1 and server.ray_actor_options == {"num_cpus": 2}
    assert (init["device"], init["threads"]) == ("cpu", 2)


def test_autoscaling_options_ray_serve_receives():
    settings, _ = on_ray._settings(replicas=None, min_replicas=2, max_replicas=6, target_ongoing_requests=16,
                                   gpus_per_replica=1, cpus_per_replica=1, options={})
    on_ray.Server.options(**settings)
    config = AutoscalingConfig(**settings["autoscaling_config"])  # as Ray Serve's autoscaler reads it
    assert (config.min_replicas, config.initial_replicas, config.max_replicas, config.target_ongoing_requests) == (
        2, 2, 6, 16)


BAD_CALLS = [
    (dict(replicas=2, min_replicas=1, max_replicas=3), ValueError, "not both"),
    (dict(min_replicas=1), ValueError, "needs both min_replicas and max_replicas"),
    (dict(min_replicas=4, max_replicas=2), ValueError, "min_replicas 4 is more than max_replicas 2"),
    (dict(replicas=0), ValueError, "replicas must be a positive integer, got 0"),
    (dict(min_replicas=1, max_replicas=2, target_ongoing_requests=0), ValueError, "target_ongoing_requests must be"),
    (dict(device="cuda:1"), ValueError, "device='cuda:1': a replica runs on 'cpu' or 'cuda'"),
    (dict(device="cpu", gpus_per_replica=1), ValueError, "gpus_per_replica=1 with device='cpu'"),
    (dict(device="cuda", gpus_per_replica=0), ValueError, "device='cuda' needs gpus_per_replica > 0"),
    (dict(cpus_per_replica=0), ValueError, "cpus_per_replica must be a number > 0, got 0"),
    (dict(max_batch_tokens=0), ValueError, "max_batch_tokens must be a positive integer, got 0"),
    (dict(batch_size=8), TypeError, "unknown option(s) batch_size"),
]


@pytest.mark.parametrize("kwargs, error, words", BAD_CALLS, ids=[str(k) for k, _, _ in BAD_CALLS])
def test_deployment_refuses_what_cannot_run_naming_the_value(kwargs, error, words):
    with pytest.raises(error) as raised:
        on_ray.deployment("unused", **kwargs)
    assert words in str(raised.value)


def test_the_parser_knows_the_ray_options():
    args = serve_parser().parse_args(["MODEL", "--ray", "auto", "--min-replicas", "1", "--max-replicas", "4",
                                      "--target-ongoing-requests", "12"])
    assert (args.ray, args.min_replicas, args.max_replicas, args.target_ongoing_requests) == ("auto", 1, 4, 12.0)
    assert serve_parser().parse_args(["--ray"]).ray == ""  # no address: $RAY_ADDRESS, a local cluster, or a new one
    assert isinstance(serve_parser(), argparse.ArgumentParser)


# ---- one replica's life, in this process (Ray Serve's replica calls these steps in this order) ---------------------
async def start_replica(model, **options):
    """What a Ray Serve replica does with the deployment class: the constructor, the app it builds, the app's
    lifespan startup (Ray Serve's ingress wrapper runs it through uvicorn's lifespan code)."""
    cls = on_ray.Server.func_or_class
    replica = cls.__new__(cls)
    await replica.__init__(model, **options)
    replica._set_asgi_app(replica.__serve_build_asgi_app__())
    await replica._run_asgi_lifespan_startup()
    return replica


# Ray Serve's wrapper has a coroutine destructor, which Ray Serve awaits itself when it stops a replica; Python calls it
# once more when the object is freed and drops that coroutine unawaited.
FREED = pytest.mark.filterwarnings("ignore:coroutine .*__del__' was never awaited:RuntimeWarning")


@FREED
def test_a_replica_starts_only_with_its_model_loaded_and_fails_health_when_its_worker_stops(minilm_path):
    async def life():
        replica = await start_replica(minilm_path, device="cpu", kernels="torch", threads=None)
        service = replica.app.state.service
        assert service.ready  # loaded before the startup returned: Ray Serve may route to it at once
        replica.check_health()
        await asyncio.get_running_loop().run_in_executor(None, service.scheduler.stop)
        with pytest.raises(RuntimeError, match="the model worker has stopped"):
            replica.check_health()  # Ray Serve replaces such a replica
        await replica.__del__()  # the lifespan's shutdown, as Ray Serve runs it
    asyncio.run(life())


@FREED
def test_a_model_that_cannot_load_fails_the_replica_with_its_reason(minilm_path, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(minilm_path, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")

    async def start():
        try:
            await start_replica(str(broken), device="cpu", kernels="torch", threads=None)
        except RuntimeError as e:
            return str(e)
    message = asyncio.run(start())
    assert re.fullmatch(r"the model failed to load: .*broken: SafetensorError: .+", message), message
