"""Where am I? TPU discovery for one host of a job.

Answers, for the host the launcher runs on: is there a TPU, which accelerator type, which host
of which slice this is, the hostnames of the slice, and the multislice layout. Each answer comes
from the first source that has it, in this order (the launcher's flags come before all of these,
see :mod:`tpu_dist.launch._config`):

1. **Environment** (:class:`EnvSource`): ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``,
   ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY`` (set on GKE TPU pods by GKE's webhook, and by
   users), ``MEGASCALE_COORDINATOR_ADDRESS`` / ``MEGASCALE_NUM_SLICES`` / ``MEGASCALE_SLICE_ID``
   (multislice, set by JobSet or queued resources), and GKE's indexed-Job
   ``JOB_COMPLETION_INDEX`` when ``TPU_WORKER_ID`` is absent.
2. **Cloud TPU metadata server** (:class:`MetadataSource`): the instance attributes
   ``agent-worker-number``, ``worker-network-endpoints``, ``accelerator-type`` and ``tpu-env``
   (as JAX's ``GceTpuCluster`` and torch_xla read them). Asked only when a TPU is attached to
   this host (or ``TPU_DIST_PLATFORM=tpu``) and ``TPU_SKIP_MDS_QUERY`` is unset, with a short
   timeout; a host without the server costs at most one timeout, never a hang.
3. **Single-host defaults**: worker 0 of a one-host slice.

Sources are small classes behind one interface (:class:`Source`); add one to :data:`SOURCES`
to teach the launcher a new environment. Knobs: ``TPU_DIST_METADATA_URL`` (default
``http://169.254.169.254/computeMetadata/v1``, the metadata server's fixed address, so no DNS
lookup can stall; ``GCE_METADATA_IP`` is honoured as in JAX) and ``TPU_DIST_METADATA_TIMEOUT``
(seconds, default 1.0).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import os
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tpu_dist import _settings
from tpu_dist.mesh import count_local_tpu_chips, tpu_attached

__all__ = [
    "Discovery",
    "EnvSource",
    "MetadataClient",
    "MetadataSource",
    "Platform",
    "SOURCES",
    "Source",
    "count_local_tpu_chips",
    "discover",
    "read_platform",
]

Platform = _settings.Platform


DEFAULT_METADATA_URL = "http://169.254.169.254/computeMetadata/v1"
DEFAULT_METADATA_TIMEOUT = float(_settings.METADATA_TIMEOUT.default)


def read_platform(environ: Mapping[str, str]) -> Platform:
    """``TPU_DIST_PLATFORM``, strictly parsed; ``"auto"`` when unset."""
    return _settings.PLATFORM.get(environ)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Discovery:
    """What the environment says about this host. ``None`` means "no source knew"."""

    on_tpu: bool
    """A TPU is attached to this host (PCI), or ``TPU_DIST_PLATFORM=tpu`` says so."""
    local_chips: int | None = None
    """TPU chips attached to this host, when counted."""
    accelerator_type: str | None = None
    """E.g. ``"v5litepod-16"``."""
    topology: str | None = None
    """The slice's chip grid when a source gave it, e.g. ``"4x4"``."""
    worker_id: int | None = None
    """This host's index within its slice."""
    worker_hostnames: tuple[str, ...] = ()
    """Hostnames or addresses of the slice's hosts, ordered by worker id."""
    num_slices: int | None = None
    """Slices in the job (multislice)."""
    slice_id: int | None = None
    """This host's slice."""
    coordinator_address: str | None = None
    """``MEGASCALE_COORDINATOR_ADDRESS``: the host of process 0 in a multislice job."""
    torch_tpu: bool = False
    """TorchTPU (the ``torch_tpu`` package) is installed: found on the path, not imported."""
    provenance: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Field name -> where its value came from (for ``--dry-run`` and error messages)."""

    @property
    def hosts_per_slice(self) -> int | None:
        """Hosts in this slice, when the hostnames are known."""
        return len(self.worker_hostnames) or None


class MetadataUnavailable(RuntimeError):
    """The metadata server did not answer (absent, unreachable or too slow)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetadataClient:
    """Reads Cloud TPU VM instance attributes from the GCE metadata server."""

    base_url: str = DEFAULT_METADATA_URL
    """Root of the metadata API, ``.../computeMetadata/v1``."""
    timeout: float = DEFAULT_METADATA_TIMEOUT
    """Seconds for one request, connection included."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> MetadataClient:
        """Honours ``TPU_DIST_METADATA_URL``, ``GCE_METADATA_IP``, ``TPU_DIST_METADATA_TIMEOUT``."""
        url = _settings.METADATA_URL.read(environ)
        if not url and environ.get("GCE_METADATA_IP"):
            url = f"http://{environ['GCE_METADATA_IP']}/computeMetadata/v1"
        timeout = _settings.METADATA_TIMEOUT.get(environ)
        return cls(base_url=(url or DEFAULT_METADATA_URL).rstrip("/"), timeout=timeout)

    def attribute(self, key: str) -> str | None:
        """One instance attribute; ``None`` if this instance does not have it.

        Raises:
            MetadataUnavailable: the server did not answer within ``timeout``.
        """
        url = f"{self.base_url}/instance/attributes/{key}"
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        # urllib's timeout does not bound name resolution; a worker thread with a deadline does.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        future = pool.submit(self._fetch, request)
        try:
            return future.result(timeout=self.timeout + 0.5)
        except concurrent.futures.TimeoutError as err:
            raise MetadataUnavailable(f"no answer from {url} within {self.timeout}s") from err
        finally:
            pool.shutdown(wait=False)

    def _fetch(self, request: urllib.request.Request) -> str | None:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read().decode()
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return None
            raise MetadataUnavailable(f"{request.full_url}: HTTP {err.code}") from err
        except (OSError, ValueError) as err:
            raise MetadataUnavailable(f"{request.full_url}: {err}") from err


@dataclasses.dataclass(frozen=True)
class DiscoveryContext:
    """What a :class:`Source` may read."""

    environ: Mapping[str, str]
    metadata: MetadataClient
    on_tpu: bool


class Source(Protocol):
    """One place discovery can look. ``read`` returns field -> value for what it knows."""

    name: str

    def read(self, ctx: DiscoveryContext) -> dict[str, Any]: ...


def _int_var(environ: Mapping[str, str], var: str) -> int | None:
    raw = environ.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError as err:
        raise ValueError(f"{var}={raw!r} is not an integer") from err


def _hostnames(raw: str) -> tuple[str, ...]:
    return tuple(h.strip() for h in raw.split(",") if h.strip())


class EnvSource:
    """TPU VM / GKE / JobSet environment variables."""

    name = "env"

    def read(self, ctx: DiscoveryContext) -> dict[str, Any]:
        env = ctx.environ
        found: dict[str, Any] = {}
        worker_id = _int_var(env, "TPU_WORKER_ID")
        if worker_id is not None:
            found["worker_id"] = (worker_id, "TPU_WORKER_ID")
        else:
            index = _int_var(env, "JOB_COMPLETION_INDEX")
            if index is not None:
                found["worker_id"] = (index, "JOB_COMPLETION_INDEX")
        if env.get("TPU_WORKER_HOSTNAMES", "").strip():
            found["worker_hostnames"] = (
                _hostnames(env["TPU_WORKER_HOSTNAMES"]),
                "TPU_WORKER_HOSTNAMES",
            )
        for var, field in (
            ("TPU_ACCELERATOR_TYPE", "accelerator_type"),
            ("TPU_TOPOLOGY", "topology"),
            ("MEGASCALE_COORDINATOR_ADDRESS", "coordinator_address"),
        ):
            if env.get(var, "").strip():
                found[field] = (env[var].strip(), var)
        for var, field in (
            ("MEGASCALE_NUM_SLICES", "num_slices"),
            ("MEGASCALE_SLICE_ID", "slice_id"),
        ):
            value = _int_var(env, var)
            if value is not None:
                found[field] = (value, var)
        return found


def _parse_tpu_env(text: str) -> dict[str, str]:
    """The ``tpu-env`` attribute: lines of ``KEY: 'value'``."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line:
            key, value = line.split(":", 1)
            values[key.strip()] = value.strip().strip("'\"")
    return values


def _parse_worker_endpoints(text: str) -> tuple[str, ...]:
    """``worker-network-endpoints``: ``host,host`` or ``name:uid:ip,...`` (old format)."""
    hosts = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) == 1:
            hosts.append(parts[0])
        elif len(parts) == 3:
            hosts.append(parts[2])
        else:
            raise ValueError(f"unsupported worker-network-endpoints entry {entry!r}")
    return tuple(hosts)


class MetadataSource:
    """The Cloud TPU VM metadata server (GCE TPU VMs and queued resources)."""

    name = "metadata"

    def read(self, ctx: DiscoveryContext) -> dict[str, Any]:
        if not ctx.on_tpu or ctx.environ.get("TPU_SKIP_MDS_QUERY"):
            return {}
        client = ctx.metadata
        where = f"metadata server ({client.base_url})"
        found: dict[str, Any] = {}
        try:
            # The first request decides: a host without the server pays one timeout, not four.
            worker = client.attribute("agent-worker-number")
            if worker is not None and worker.strip():
                found["worker_id"] = (int(worker.strip()), f"{where}: agent-worker-number")
            endpoints = client.attribute("worker-network-endpoints")
            if endpoints:
                found["worker_hostnames"] = (
                    _parse_worker_endpoints(endpoints),
                    f"{where}: worker-network-endpoints",
                )
            accelerator = client.attribute("accelerator-type")
            if accelerator and accelerator.strip():
                found["accelerator_type"] = (accelerator.strip(), f"{where}: accelerator-type")
            tpu_env = _parse_tpu_env(client.attribute("tpu-env") or "")
        except MetadataUnavailable:
            return found
        for key, field, convert in (
            ("TOPOLOGY", "topology", str),
            ("ACCELERATOR_TYPE", "accelerator_type", str),
            ("WORKER_ID", "worker_id", int),
            ("MEGASCALE_COORDINATOR_ADDRESS", "coordinator_address", str),
            ("MEGASCALE_NUM_SLICES", "num_slices", int),
            ("MEGASCALE_SLICE_ID", "slice_id", int),
        ):
            if tpu_env.get(key) and field not in found:
                try:
                    found[field] = (convert(tpu_env[key]), f"{where}: tpu-env {key}")
                except ValueError as err:
                    raise ValueError(
                        f"metadata tpu-env has {key}={tpu_env[key]!r}, expected {convert.__name__}"
                    ) from err
        return found


SOURCES: tuple[Source, ...] = (EnvSource(), MetadataSource())
"""Discovery sources, most trusted first."""


def discover(
    environ: Mapping[str, str] | None = None,
    *,
    sources: Sequence[Source] = SOURCES,
    metadata: MetadataClient | None = None,
    sysfs_root: str = "/sys",
    dev_root: str = "/dev",
) -> Discovery:
    """Looks at this host's environment; never blocks longer than the metadata timeout.

    Args:
        environ: the environment to read (default ``os.environ``).
        sources: where to look, most trusted first.
        metadata: the metadata client (default: from ``environ``).
        sysfs_root: where to count PCI TPU chips (tests point it at a fake tree).
        dev_root: where TPU device files are, if sysfs has no PCI tree
            (:func:`tpu_dist.mesh.tpu_attached`).
    """
    env = dict(os.environ if environ is None else environ)
    platform = read_platform(env)
    local_chips = count_local_tpu_chips(sysfs_root)
    on_tpu = platform == "tpu" or (platform == "auto" and tpu_attached(sysfs_root=sysfs_root, dev_root=dev_root))
    ctx = DiscoveryContext(
        environ=env, metadata=metadata or MetadataClient.from_env(env), on_tpu=on_tpu
    )
    fields: dict[str, Any] = {}
    provenance: dict[str, str] = {}
    for source in sources:
        for field, (value, where) in source.read(ctx).items():
            if field not in fields:
                fields[field] = value
                provenance[field] = where
    if local_chips:
        provenance["local_chips"] = f"PCI scan of {sysfs_root}"
    torch_tpu = importlib.util.find_spec("torch_tpu") is not None
    return Discovery(
        on_tpu=on_tpu,
        local_chips=local_chips or None,
        torch_tpu=torch_tpu,
        provenance=provenance,
        **fields,
    )
