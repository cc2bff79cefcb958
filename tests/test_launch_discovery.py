"""tpu-launch discovery: environment, a fake Cloud TPU metadata server, precedence, timeouts.

The metadata server is faked on loopback (an HTTP server, a socket that never answers, a closed
port); none of these tests may take longer than the configured timeout plus a little.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch_worker import free_port
from tpu_dist.launch import Discovery, MetadataClient, discover

ATTRIBUTES = {
    "agent-worker-number": "1",
    "worker-network-endpoints": "t1k-w-0:uid0:10.0.0.2,t1k-w-1:uid1:10.0.0.3",  # old format
    "accelerator-type": "v4-16",
    "tpu-env": "ACCELERATOR_TYPE: 'v4-16'\nTOPOLOGY: '2x2x2'\nWORKER_ID: '1'\nZONE: 'us-c2-b'\n",
}


Server = tuple[str, list[str]]
"""A fake metadata server: its base URL and the paths it was asked for."""


class _FakeMetadata(http.server.BaseHTTPRequestHandler):
    attributes: dict[str, str] = ATTRIBUTES
    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        type(self).requests.append(self.path)
        key = self.path.rsplit("/", 1)[-1]
        if self.headers.get("Metadata-Flavor") != "Google" or key not in self.attributes:
            self.send_response(404)
            self.end_headers()
            return
        body = self.attributes[key].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata_server() -> Iterator[Server]:
    """A fake metadata server; yields (base URL, list of request paths)."""
    _FakeMetadata.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeMetadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/computeMetadata/v1", _FakeMetadata.requests
    finally:
        server.shutdown()
        server.server_close()


def test_no_tpu_is_single_host_and_never_asks_the_metadata_server(metadata_server: Server) -> None:
    url, requests = metadata_server
    found = discover({}, metadata=MetadataClient(base_url=url), sysfs_root="/nonexistent", dev_root="/nonexistent")
    assert found == Discovery(on_tpu=False)
    assert requests == []


def test_env_source_reads_gke_and_multislice_variables() -> None:
    env = {
        "TPU_WORKER_ID": "2",
        "TPU_WORKER_HOSTNAMES": "w-0.svc, w-1.svc,w-2.svc,w-3.svc",
        "TPU_ACCELERATOR_TYPE": "v5litepod-16",
        "TPU_TOPOLOGY": "4x4",
        "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1",
        "MEGASCALE_COORDINATOR_ADDRESS": "w-0.slice0.svc",
        "TPU_SKIP_MDS_QUERY": "true",
    }
    found = discover(env, sysfs_root="/nonexistent", dev_root="/nonexistent")
    assert found.worker_id == 2 and found.worker_hostnames == (
        "w-0.svc",
        "w-1.svc",
        "w-2.svc",
        "w-3.svc",
    )
    assert (found.accelerator_type, found.topology) == ("v5litepod-16", "4x4")
    assert (found.num_slices, found.slice_id, found.coordinator_address) == (2, 1, "w-0.slice0.svc")
    assert found.provenance["worker_id"] == "TPU_WORKER_ID"
    assert not found.on_tpu  # variables alone do not make a TPU


def test_gke_job_completion_index_when_no_worker_id() -> None:
    found = discover({"JOB_COMPLETION_INDEX": "3"}, sysfs_root="/nonexistent", dev_root="/nonexistent")
    assert (found.worker_id, found.provenance["worker_id"]) == (3, "JOB_COMPLETION_INDEX")
    both = discover({"JOB_COMPLETION_INDEX": "3", "TPU_WORKER_ID": "0"}, sysfs_root="/nonexistent", dev_root="/nonexistent")
    assert both.worker_id == 0


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"TPU_WORKER_ID": "one"}, "TPU_WORKER_ID='one' is not an integer"),
        ({"TPU_DIST_PLATFORM": "quantum"}, "TPU_DIST_PLATFORM='quantum'"),
        ({"TPU_DIST_METADATA_TIMEOUT": "soon"}, "TPU_DIST_METADATA_TIMEOUT='soon'"),
    ],
)
def test_bad_variables_are_named(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        discover(env, sysfs_root="/nonexistent", dev_root="/nonexistent")


def test_metadata_server_fills_what_the_env_does_not(metadata_server: Server) -> None:
    url, requests = metadata_server
    env = {"TPU_DIST_PLATFORM": "tpu", "TPU_DIST_METADATA_URL": url}
    found = discover(env, sysfs_root="/nonexistent", dev_root="/nonexistent")
    assert found.on_tpu and found.worker_id == 1
    assert found.worker_hostnames == ("10.0.0.2", "10.0.0.3")
    assert (found.accelerator_type, found.topology) == ("v4-16", "2x2x2")
    assert found.provenance["worker_id"].endswith("agent-worker-number")
    assert found.num_slices is None  # absent from tpu-env: single slice
    # The environment beats the metadata server, field by field.
    found = discover({**env, "TPU_WORKER_ID": "0"}, sysfs_root="/nonexistent", dev_root="/nonexistent")
    assert (found.worker_id, found.provenance["worker_id"]) == (0, "TPU_WORKER_ID")
    assert found.worker_hostnames == ("10.0.0.2", "10.0.0.3")
    # TPU_SKIP_MDS_QUERY (set by GKE and JAX) keeps it quiet.
    before = len(requests)
    discover({**env, "TPU_SKIP_MDS_QUERY": "1"}, sysfs_root="/nonexistent", dev_root="/nonexistent")
    assert len(requests) == before


def test_metadata_new_endpoint_format(
    metadata_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = metadata_server
    monkeypatch.setattr(
        _FakeMetadata, "attributes", {**ATTRIBUTES, "worker-network-endpoints": "a,b"}
    )
    found = discover(
        {"TPU_DIST_PLATFORM": "tpu"}, metadata=MetadataClient(base_url=url), sysfs_root="/x", dev_root="/x"
    )
    assert found.worker_hostnames == ("a", "b")


def test_metadata_server_that_never_answers_times_out_quickly() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections (kernel backlog) but never replies
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/computeMetadata/v1"
        started = time.monotonic()
        found = discover(
            {"TPU_DIST_PLATFORM": "tpu"},
            metadata=MetadataClient(base_url=url, timeout=0.3),
            sysfs_root="/nonexistent", dev_root="/nonexistent",
        )
        elapsed = time.monotonic() - started
    finally:
        silent.close()
    assert found.on_tpu and found.worker_id is None  # single-host defaults apply later
    assert elapsed < 2.0, f"discovery took {elapsed:.1f}s with a 0.3s metadata timeout"


def test_metadata_server_absent_is_fast() -> None:
    url = f"http://127.0.0.1:{free_port()}/computeMetadata/v1"  # nothing listens there
    started = time.monotonic()
    found = discover({"TPU_DIST_PLATFORM": "tpu", "TPU_DIST_METADATA_URL": url}, sysfs_root="/x", dev_root="/x")
    assert found.worker_id is None and time.monotonic() - started < 2.0


def test_metadata_client_from_env() -> None:
    assert MetadataClient.from_env({}).base_url == "http://169.254.169.254/computeMetadata/v1"
    assert MetadataClient.from_env({"GCE_METADATA_IP": "10.1.2.3"}).base_url.startswith(
        "http://10.1.2.3/"
    )
    assert MetadataClient.from_env({"TPU_DIST_METADATA_TIMEOUT": "0.25"}).timeout == 0.25


def test_pci_scan_counts_tpu_chips(tmp_path: Path) -> None:
    devices = {
        "0000:00:04.0": ("0x1ae0", "0x005e"),
        "0000:00:05.0": ("0x1ae0", "0x005e"),
        "0000:00:06.0": ("0x1ae0", "0x1234"),
        "0000:00:07.0": ("0x10de", "0x005e"),
    }
    for name, (vendor, device) in devices.items():
        path = tmp_path / "bus/pci/devices" / name
        path.mkdir(parents=True)
        (path / "vendor").write_text(vendor + "\n")
        (path / "device").write_text(device + "\n")
    found = discover({"TPU_SKIP_MDS_QUERY": "1"}, sysfs_root=str(tmp_path))
    assert found.on_tpu and found.local_chips == 2
    # TPU_DIST_PLATFORM=cpu overrides the hardware.
    assert not discover({"TPU_DIST_PLATFORM": "cpu"}, sysfs_root=str(tmp_path)).on_tpu


def test_one_tpu_detector_for_the_launcher_and_the_backend(tmp_path) -> None:
    """tpu_dist.mesh.tpu_attached: PCI chips (Google's vendor id, a TPU device id) decide; the
    device files only where sysfs has no PCI tree. The launcher's discovery and the backend's
    TPU_DIST_PLATFORM=auto both use it."""
    from tpu_dist.mesh import count_local_tpu_chips, tpu_attached, tpu_device_files

    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "12").write_text("")  # another passed-through PCI device
    pci = sysfs / "bus" / "pci" / "devices"
    for name, vendor, device in [("0000:00:04.0", "0x1ae0", "0x0063"),
                                 ("0000:00:05.0", "0x1ae0", "0x1234"),  # Google, not a TPU
                                 ("0000:00:06.0", "0x8086", "0x0063")]:
        (pci / name).mkdir(parents=True)
        (pci / name / "vendor").write_text(vendor + "\n")
        (pci / name / "device").write_text(device + "\n")
    assert count_local_tpu_chips(str(sysfs)) == 1
    assert tpu_attached(sysfs_root=str(sysfs), dev_root=str(dev))
    assert discover({}, sysfs_root=str(sysfs), dev_root=str(dev),
                    metadata=MetadataClient(base_url="http://127.0.0.1:9")).on_tpu
    (pci / "0000:00:04.0" / "device").write_text("0x9999\n")
    # A vfio group alone does not make a TPU while the PCI tree says otherwise.
    assert not tpu_attached(sysfs_root=str(sysfs), dev_root=str(dev))
    # Without a PCI tree (some containers) the device files decide.
    assert tpu_device_files(str(dev)) == [str(dev / "vfio" / "12")]
    assert tpu_attached(sysfs_root=str(tmp_path / "nosys"), dev_root=str(dev))
    assert not tpu_attached(sysfs_root=str(tmp_path / "nosys"), dev_root=str(tmp_path / "nodev"))
