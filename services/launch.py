"""`dsde serve`: start a local Ray, run the app on it, print the URL, block, and stop everything on Ctrl-C or
SIGTERM (Serve first, then Ray: the cluster this process started and nothing else). Stopping is graceful: the
replica is drained first (new requests get 503, running ones finish within graceful_shutdown_timeout_s).

Ray runs without its dashboard here, and the dashboard is what writes Prometheus' service-discovery file; so `dsde
serve` writes that file itself, where Ray's would be (deploy/prometheus/prometheus.yml reads it), and removes it when
it stops."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsde_core.errors import ConfigError, DSDEError, ModelLoadError
from dsde_core.models.loader import model_source_exists
from dsde_core.models.packaged import EMBEDDED
from services.config import PolicyConfig, ServiceConfig
from services.placement import strip_exception_type

APP_NAME = "dsde"
SD_AUTO = "auto"  # LocalServe.prometheus_sd: the file Ray's dashboard would write, in Ray's temp dir


@dataclass
class LocalServe:
    args: dict[str, Any] = field(default_factory=dict)  # build_app args (ServiceConfig fields, user_config)
    host: str = "127.0.0.1"
    port: int = 8000
    num_cpus: int | None = None  # Ray's logical CPUs; None: the machine's
    metrics_port: int | None = 8080  # Prometheus endpoint of Ray's metrics export; None: Ray picks one
    object_store_memory: int = 256 * 2**20
    worker_niceness: int | None = 0  # Ray runs workers (the model actors) at nice 15 unless told; None: Ray's
    prometheus_sd: str | None = SD_AUTO  # Prometheus' service-discovery file to write (SD_AUTO: Ray's); None: none

    def check(self) -> None:
        """Fail before Ray starts: bad args, a model source that is not there, ports already taken."""
        cfg = ServiceConfig.from_args(_without_user_config(self.args))
        for role, source in (("--target", cfg.target), ("--draft", cfg.draft)):
            if source is not None and not model_source_exists(source):
                raise ModelLoadError(f"{role} {source!r} is not an embedded model name ({', '.join(EMBEDDED)}), "
                                     f"a local Hugging Face model directory or a local .gguf file")
        if "user_config" in self.args:
            PolicyConfig.from_dict(self.args["user_config"])
        if self.prometheus_sd not in (None, SD_AUTO):
            folder = Path(self.prometheus_sd).expanduser().parent
            if not folder.is_dir() or not os.access(folder, os.W_OK):
                raise ConfigError(f"--prometheus-sd {self.prometheus_sd!r}: {folder} is not a writable directory")
        needs = cfg.draft_num_cpus * (cfg.draft is not None) + cfg.target_num_cpus + cfg.controller_num_cpus
        if self.num_cpus is not None and self.num_cpus < needs:  # the actors would wait for CPUs forever
            raise ConfigError(f"--num-cpus {self.num_cpus}: the model actors need {needs:g} of the cluster's "
                              f"logical CPUs")
        gpus, seen = cfg.draft_num_gpus * (cfg.draft is not None) + cfg.target_num_gpus, torch.cuda.device_count()
        if gpus > seen:  # as above, for GPUs; torch's count: the actors' torch must see them
            raise ConfigError(f"--num-gpus: the model actors need {gpus:g} GPUs, and torch sees {seen} on this machine")
        if self.worker_niceness is not None and not -20 <= self.worker_niceness <= 19:
            raise ConfigError(f"--worker-niceness must be a nice level in [-20, 19], got {self.worker_niceness}")
        ports = [(name, port) for name, port in (("--port", self.port), ("--metrics-port", self.metrics_port))
                 if port is not None]
        for name, port in ports:
            if not 0 < port < 65536:
                raise ConfigError(f"{name} must be a port in [1, 65535], got {port}")
        for name, port in ports:
            if problem := _cannot_listen(name, self.host if name == "--port" else "127.0.0.1", port):
                raise ConfigError(problem)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _cannot_listen(flag: str, host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (the port taken, the host no address of this machine), as an
    error naming the flag to change; None: it could."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as e:
            return f"--host {host!r} is not a host name or address ({e.strerror})"
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"{flag} {port} is already in use; pick another one"
            return f"--host {host}: cannot listen on {host}:{port} ({e.strerror or e})"
    return None


SERVE_CONTROL_LOOP_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
SERVE_CONTROL_LOOP_S = "0.5"


def quiet_serve_controller() -> None:
    """Serve's controller reconciles every 0.1 s by default: a few percent of a core, taken from the model actors (on
    a 2-core machine every stolen millisecond stalls both of torch's threads). One app with fixed replicas needs no
    faster loop than 0.5 s. Read by the controller process when Ray starts it; an operator's own value wins."""
    os.environ.setdefault(SERVE_CONTROL_LOOP_ENV, SERVE_CONTROL_LOOP_S)


@contextlib.contextmanager
def local_cluster(opts: LocalServe, with_serve: bool = True) -> Iterator[None]:
    """A local Ray with Serve's HTTP proxy on opts.host:opts.port (with_serve=False: Ray alone), as `dsde serve` runs
    it; on exit Serve stops first, then Ray: the cluster this process started and nothing else."""
    import ray
    from ray import serve

    # worker_niceness 0: at Ray's default of 15, any other busy process on the machine (a load generator, a
    # build) takes the CPU from the model actors; this cluster exists only to serve, so they run at normal priority
    system_config = {} if opts.worker_niceness is None else {"worker_niceness": opts.worker_niceness}
    quiet_serve_controller()
    ray.init(address="local", num_cpus=opts.num_cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=opts.object_store_memory, _metrics_export_port=opts.metrics_port,
             _system_config=system_config)
    try:
        if with_serve:
            serve.start(http_options={"host": opts.host, "port": opts.port})
        yield
    finally:
        if not cluster_gone():
            with contextlib.suppress(Exception):
                serve.shutdown()
        ray.shutdown()


def cluster_gone(wait_s: float = 0.0) -> bool:
    """Whether this process's Ray cluster has died under it (its GCS no longer takes connections), waiting up to
    `wait_s` for it to go. So it goes when a stop signal reaches the whole process group, of which Ray's GCS and
    raylet are members (`kill -- -PGID`, systemd's default KillMode, `timeout`): a SIGTERM takes the GCS ~0.1 s
    after it reached this process, and every Ray call would then wait a minute for the GCS to come back."""
    import ray

    try:
        gcs = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - no runtime context: this process is no longer connected to a cluster
        return True
    deadline = time.monotonic() + wait_s
    while _accepts(gcs, timeout=1):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _accepts(address: str, timeout: float) -> bool:
    """Whether host:port takes a TCP connection within `timeout` seconds."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def serve_forever(opts: LocalServe, stop: threading.Event | None = None, log: Any = print) -> int:
    """Run until `stop` is set or SIGINT/SIGTERM arrives; returns the exit code."""
    opts.check()
    stop = stop or threading.Event()
    t0 = time.perf_counter()
    previous = {}
    ready = threading.Event()

    def on_signal(*_: Any) -> None:
        if not ready.is_set():
            raise KeyboardInterrupt  # still starting: abort serve.run; the cluster is stopped on the way out
        stop.set()

    try:
        with local_cluster(opts):
            if threading.current_thread() is threading.main_thread():  # after ray.init, which installs its own
                for sig in (signal.SIGINT, signal.SIGTERM):
                    previous[sig] = signal.signal(sig, on_signal)
            try:
                return _serve_until_stopped(opts, stop, ready, log, t0)
            finally:
                ready.set()  # a second signal while shutting down only sets `stop`
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve_until_stopped(opts: LocalServe, stop: threading.Event, ready: threading.Event, log: Any,
                         t0: float) -> int:
    """On a running cluster: the app up, `ready` set, then wait for `stop` and drain."""
    from ray import serve

    from services.app import build_app

    sd = _write_service_discovery(opts, log)  # Ray's metrics (Serve's included) are worth scraping while it loads
    try:
        log("dsde serve: loading the models (the first start converts the embedded pair; minutes) ...")
        try:
            serve.run(build_app(opts.args), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as e:
            raise ServiceStartError(f"the service failed to start: {_deploy_failure(serve) or e}") from None
        log(f"dsde serve: ready in {time.perf_counter() - t0:.0f}s at {opts.url}/v1 "
            f"(OpenAI API; model {ServiceConfig.from_args(_without_user_config(opts.args)).served_name!r})")
        if opts.metrics_port:
            log(f"dsde serve: Prometheus metrics at http://127.0.0.1:{opts.metrics_port}/metrics (ray_dsde_*)")
        log("dsde serve: Ctrl-C or SIGTERM stops it")
        ready.set()
        while not stop.wait(0.5):
            pass
        if cluster_gone(wait_s=1.0):
            log("dsde serve: stopping: the Ray cluster's own processes got the signal too and are gone, the "
                "service with them; nothing to drain (send SIGINT or SIGTERM to this process alone to drain)")
            return 0
        grace = ServiceConfig.from_args(_without_user_config(opts.args)).graceful_shutdown_timeout_s
        log(f"dsde serve: stopping: new requests get 503; running ones get up to {grace:g}s to finish")
        left = drain(grace)
        log("dsde serve: drained" if left == 0 else f"dsde serve: {left} request(s) still running; stopping anyway")
        return 0
    finally:
        if sd is not None:
            sd.remove()


def _write_service_discovery(opts: LocalServe, log: Any) -> ServiceDiscovery | None:
    """Write Prometheus' service-discovery file for the running cluster (None: not asked for, or not writable)."""
    import ray

    if opts.prometheus_sd is None:
        return None
    path = _sd_path(opts.prometheus_sd, ray)
    try:
        sd = ServiceDiscovery.write(path, _metrics_targets(ray))
    except OSError as e:  # monitoring is no reason not to serve
        log(f"dsde serve: warning: could not write Prometheus' service-discovery file {path}: {e}")
        return None
    log(f"dsde serve: Prometheus service discovery: {sd.path} ({', '.join(sd.targets)})")
    return sd


def drain(timeout: float, app_name: str = APP_NAME) -> int:
    """Tell the app's replica to refuse new requests, then wait up to `timeout` s for the running ones to finish.
    Returns how many are left (-1: the replica could not be reached)."""
    from ray import serve

    try:
        handle = serve.get_app_handle(app_name)
        left = handle.drain.remote().result(timeout_s=30)
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            time.sleep(0.25)
            left = handle.in_flight.remote().result(timeout_s=30)
        return left
    except Exception:  # noqa: BLE001 - shutting down regardless: Serve's own graceful shutdown still applies
        return -1


@dataclass
class ServiceDiscovery:
    """Our group in a Prometheus file_sd file, naming the cluster's metrics endpoints as Ray's dashboard does (job
    "ray"). Several `dsde serve` on one machine share Ray's file: each adds its own group and takes out only its own,
    so that one stopping (or starting) does not hide the others from Prometheus."""

    path: Path
    targets: list[str]

    @classmethod
    def write(cls, path: Path, targets: list[str]) -> ServiceDiscovery:
        """Add our group, keeping the groups of other clusters that still answer (a killed one's is dropped)."""
        group = {"labels": {"job": "ray"}, "targets": targets}
        with _locked(path):
            # a group none of whose endpoints answers was left by a cluster that was killed
            others = [g for g in _groups(path) if g.get("targets") != targets
                      and any(_accepts(str(t), timeout=0.5) for t in g.get("targets", []))]
            _replace(path, [*others, group])
        return cls(path, targets)

    def remove(self) -> None:
        """Take our group out; the file goes when no group is left."""
        with contextlib.suppress(OSError), _locked(self.path):
            left = [g for g in _groups(self.path) if g.get("targets") != self.targets]
            if left:
                _replace(self.path, left)
            else:
                self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One read-modify-write of the file at a time among the processes on this machine."""
    import fcntl

    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _groups(path: Path) -> list[dict[str, Any]]:
    try:
        groups = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or not ours to understand: started afresh
        return []
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []


def _replace(path: Path, groups: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)  # whole or not at all: Prometheus re-reads the file whenever it changes


def _sd_path(option: str, ray: Any) -> Path:
    if option != SD_AUTO:
        return Path(option).expanduser()
    name = ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE  # the name Ray's dashboard writes
    return Path(ray._private.worker._global_node.get_temp_dir_path()) / name


def _metrics_targets(ray: Any) -> list[str]:
    """host:port of every live node's metrics export (here: this machine's one node)."""
    return [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n.get("Alive")]


class ServiceStartError(DSDEError):
    """The app did not reach RUNNING (typically a model that could not be loaded)."""


def _deploy_failure(serve: Any) -> str:
    """The most specific message Serve holds about why the app failed (the replica's exception)."""
    try:
        app = serve.status().applications[APP_NAME]
    except Exception:
        return ""
    messages = [d.message for d in app.deployments.values() if d.message] + [app.message]
    text = next((m.strip() for m in messages if m and m.strip()), "")
    return strip_exception_type(text.splitlines()[-1]) if text else ""


def _without_user_config(args: dict[str, Any]) -> dict[str, Any]:
    """The app args less user_config: ServiceConfig's fields alone."""
    return {k: v for k, v in args.items() if k != "user_config"}
