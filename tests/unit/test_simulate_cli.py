from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from api.hami.catalog import simulated_gpu_uuid, simulated_register_json
from scheduler_plugins.cli import main

EX = Path(__file__).resolve().parents[2] / "examples"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, [line for line in out.splitlines() if line], err


def _json(capsys: pytest.CaptureFixture[str], cluster: str, pods: str) -> list[dict[str, object]]:
    code, lines, _ = _run(
        capsys,
        "simulate",
        "--cluster",
        str(EX / cluster),
        "--pods",
        str(EX / pods),
        "--output",
        "json",
    )
    assert code == 0
    return [json.loads(line) for line in lines]


def test_seed_binpack_puts_both_pods_on_node1(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "seed-node-score/cluster.yaml", "seed-node-score/pods-binpack.yaml")
    assert [(r["pod"], r["node"]) for r in out] == [
        ("default/pod1", "node1"),
        ("default/pod2", "node1"),
    ]
    assert "node score 19.75" in str(out[0]["reason"])


def test_seed_spread_first_pod_goes_to_the_lower_node(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "seed-node-score/cluster.yaml", "seed-node-score/pods-spread.yaml")
    assert [r["node"] for r in out] == ["node2", "node1"]
    assert "node score 10.50" in str(out[0]["reason"])


def test_mig_example_output_annotations_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    (r,) = _json(capsys, "dynamic-mig/cluster.yaml", "dynamic-mig/pods.yaml")
    assert r["status"] == "Scheduled"
    ann = r["annotations"]
    assert isinstance(ann, dict)
    assert set(ann) == {
        "hami.io/vgpu-node",
        "hami.io/vgpu-devices-allocated",
        "hami.io/vgpu-devices-to-allocate",
        "hami.io/vgpu-mig-allocations",
    }
    mig = json.loads(ann["hami.io/vgpu-mig-allocations"])
    assert [m["profile"] for m in mig] == ["2g.10gb", "2g.10gb"]
    uuid = mig[0]["gpuUUID"]
    assert ann["hami.io/vgpu-devices-allocated"] == f"{uuid},NVIDIA,9984,29:{uuid},NVIDIA,9984,29:;"


def test_fragmentation_stays_unschedulable_with_reason(capsys: pytest.CaptureFixture[str]) -> None:
    (r,) = _json(capsys, "mig-fragmentation/cluster.yaml", "mig-fragmentation/pods.yaml")
    assert r["status"] == "Unschedulable" and r["node"] is None and r["annotations"] == {}
    assert "fragmentation" in str(r["reason"]) and "[6,8)" in str(r["reason"])


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = _run(
        capsys,
        "simulate",
        "--cluster",
        str(EX / "seed-gpu-score/cluster.yaml"),
        "--pods",
        str(EX / "seed-gpu-score/pods.yaml"),
    )
    assert code == 0
    assert lines[0].split()[:4] == ["POD", "STATUS", "NODE", "DEVICES"]
    assert "GPU score 9.75" in lines[1]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("kind: Node\nmetadata: {name: n}\nmetadata: [", "not valid YAML"),
        ("kind: Service\nmetadata: {name: s}\n", "expected a Node or Pod"),
        (
            "kind: Pod\nmetadata: {name: p}\nspec: {nodeName: ghost, containers: []}\n"
            "status: {phase: Running}\n",
            "",
        ),
        ("kind: Pod\nmetadata: {}\n", "has no metadata.name"),
    ],
)
def test_invalid_cluster_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, fragment: str
) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text(content)
    code, lines, err = _run(
        capsys,
        "simulate",
        "--cluster",
        str(bad),
        "--pods",
        str(EX / "dynamic-mig/pods.yaml"),
        "--output",
        "json",
    )
    if not fragment:  # a pod on an unknown node without GPU annotations holds nothing
        assert code == 0
        return
    assert code == 2 and lines == []
    assert len(err.strip().splitlines()) == 1
    assert str(bad) in err and fragment in err


def test_invalid_pod_request_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text(
        "kind: Pod\nmetadata: {name: greedy}\nspec:\n  containers:\n  - name: c\n"
        "    resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpucores: 150}}\n"
    )
    code, _, err = _run(
        capsys,
        "simulate",
        "--cluster",
        str(EX / "dynamic-mig/cluster.yaml"),
        "--pods",
        str(pods),
        "--output",
        "json",
    )
    assert code == 2
    assert "Pod default/greedy" in err and "nvidia.com/gpucores" in err


def test_config_convert_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "old.yaml"
    old.write_text(
        "nvidia:\n  knownMigGeometries:\n  - models: [A30]\n    allowedGeometries:\n"
        "    - - {name: 1g.6gb, memory: 6144, count: 4}\n"
    )
    code, _, err = _run(
        capsys,
        "simulate",
        "--cluster",
        str(EX / "dynamic-mig/cluster.yaml"),
        "--pods",
        str(EX / "dynamic-mig/pods.yaml"),
        "--config",
        str(old),
    )
    assert code == 2 and "tessera config convert" in err
    new = tmp_path / "new.yaml"
    assert main(["config", "convert", str(old), "-o", str(new)]) == 0
    assert main(["config", "check", str(new)]) == 0
    assert "migProfileAllowlist" in new.read_text()


def test_a_node_whose_gpus_cannot_be_read_is_skipped_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the live scheduler does: the rest of the cluster is simulated; the node and the pods
    bound to it are named with the reason, on stderr and under the table."""
    cluster = tmp_path / "cluster.yaml"
    good = (EX / "dynamic-mig/cluster.yaml").read_text()
    cluster.write_text(
        good + "\n---\nkind: Node\nmetadata: {name: broken, annotations: "
        "{hami.io/node-nvidia-register: 'x'}}\n"
        "---\nkind: Pod\nmetadata: {name: old}\nspec: {nodeName: broken, containers: []}\n"
        "status: {phase: Running}\n"
    )
    args = ("simulate", "--cluster", str(cluster), "--pods", str(EX / "dynamic-mig/pods.yaml"))
    code, lines, err = _run(capsys, *args, "--output", "json")
    assert code == 0
    assert json.loads(lines[0])["status"] == "Scheduled"
    assert "Node broken skipped: annotation hami.io/node-nvidia-register" in err
    assert "not valid JSON" in err
    code, lines, err = _run(capsys, *args)
    assert code == 0
    assert any(line.startswith("warning: Node broken skipped") for line in lines)


def _node_yaml(name: str, register: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "annotations": {"hami.io/node-nvidia-register": register}},
            "status": {"allocatable": {"cpu": "32", "memory": "256Gi"}},
        }
    )


def _pod_yaml(name: str, mode: str | None, mem: int, cores: int, node: str = "") -> str:
    pod: dict[str, object] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {"nvidia.com/vgpu-mode": mode} if mode else {}},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "resources": {
                        "limits": {
                            "nvidia.com/gpu": 1,
                            "nvidia.com/gpumem": mem,
                            "nvidia.com/gpucores": cores,
                        }
                    },
                }
            ]
        },
    }
    return yaml.safe_dump(pod)


def test_a_what_if_with_an_mps_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """MPS nodes as their node agent registers them ("mode":"mps"); MPS pods go there with
    hami-core's device strings, and a pod that fits no MPS GPU is told why."""
    model = "A100-PCIE-40GB"
    mps_uuids = [simulated_gpu_uuid("mps-node", i) for i in range(2)]
    cluster = tmp_path / "cluster.yaml"
    existing = _pod_yaml("old", None, 30000, 0)
    old = yaml.safe_load(existing)
    old["spec"]["nodeName"] = "mps-node"
    old["status"] = {"phase": "Running"}
    written = f"{mps_uuids[0]},NVIDIA,30000,0:;"
    old["metadata"]["annotations"] = {
        "hami.io/vgpu-node": "mps-node",
        "hami.io/bind-phase": "success",
        "hami.io/vgpu-devices-allocated": written,
    }
    cluster.write_text(
        "---\n".join(
            [
                _node_yaml(
                    "core-node", simulated_register_json("core-node", model, 2, "hami-core")
                ),
                _node_yaml("mps-node", simulated_register_json("mps-node", model, 2, "mps")),
                yaml.safe_dump(old),
            ]
        )
    )
    pods = tmp_path / "pods.yaml"
    pods.write_text(
        "---\n".join(
            [
                _pod_yaml("client", "mps", 20000, 30),
                _pod_yaml("core", "hami-core", 20000, 30),
                _pod_yaml("too-big", "mps", 30000, 0),  # 40960 − 30000 and 40960 − 20000 left
            ]
        )
    )
    args = ("simulate", "--cluster", str(cluster), "--pods", str(pods))
    code, lines, _ = _run(capsys, *args, "--output", "json")
    assert code == 0
    client, core, too_big = (json.loads(line) for line in lines)
    # Spread by default: the MPS GPU nobody uses yet.
    assert (client["status"], client["node"]) == ("Scheduled", "mps-node")
    devices = f"{mps_uuids[1]},NVIDIA,20000,30:;"
    assert client["annotations"] == {
        "hami.io/vgpu-node": "mps-node",
        "hami.io/vgpu-devices-allocated": devices,
        "hami.io/vgpu-devices-to-allocate": devices,
    }
    assert core["node"] == "core-node"
    assert too_big["status"] == "Unschedulable"
    reason = str(too_big["reason"])
    assert "NVIDIA A100-PCIE-40GB (mps)]: insufficient GPU memory (mps-node)" in reason
    assert "(hami-core)]: GPU mode does not match nvidia.com/vgpu-mode (core-node)" in reason
    code, lines, _ = _run(capsys, *args)
    assert code == 0
    assert f"{mps_uuids[1][:12]}:20000MiB/30%" in lines[1]


def _placed(name: str, node: str, uuid: str, mem: int, priority: int, started: str) -> str:
    pod = yaml.safe_load(_pod_yaml(name, "hami-core", mem, 0))
    pod["spec"]["nodeName"] = node
    pod["spec"]["priority"] = priority
    pod["status"] = {"phase": "Running", "startTime": started}
    pod["metadata"]["annotations"].update(
        {
            "hami.io/vgpu-node": node,
            "hami.io/bind-phase": "success",
            "hami.io/vgpu-devices-allocated": f"{uuid},NVIDIA,{mem},0:;",
        }
    )
    return yaml.safe_dump(pod)


def test_a_pod_that_fits_nowhere_is_shown_whom_preemption_would_preempt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kube-scheduler's choice: on each node it reprieves the more important pods first (the
    older of two of a priority), then takes the node whose victims' highest priority is
    lowest. The victims stay (they are only shown)."""
    model = "A100-PCIE-40GB"  # 40960 MiB
    x, y = simulated_gpu_uuid("x", 0), simulated_gpu_uuid("y", 0)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        "---\n".join(
            [
                _node_yaml("x", simulated_register_json("x", model, 1, "hami-core")),
                _node_yaml("y", simulated_register_json("y", model, 1, "hami-core")),
                _placed("x-old", "x", x, 20000, 0, "2024-01-01T00:00:00Z"),
                _placed("x-new", "x", x, 20000, 0, "2024-06-01T00:00:00Z"),
                _placed("y-only", "y", y, 30000, 1, "2024-01-01T00:00:00Z"),
            ]
        )
    )
    urgent = yaml.safe_load(_pod_yaml("urgent", "hami-core", 15000, 0))
    urgent["spec"]["priority"] = 100
    pods = tmp_path / "pods.yaml"
    pods.write_text(
        "---\n".join([yaml.safe_dump(urgent), _pod_yaml("ordinary", "hami-core", 15000, 0)])
    )
    args = ("simulate", "--cluster", str(cluster), "--pods", str(pods))
    code, lines, _ = _run(capsys, *args, "--output", "json")
    assert code == 0
    first, second = (json.loads(line) for line in lines)
    assert first["status"] == "Unschedulable" and first["node"] is None
    assert first["preempt"] == {"node": "x", "victims": ["default/x-new"]}
    assert "would preempt default/x-new on node x" in first["reason"]
    assert "PodDisruptionBudgets not modelled" in first["reason"]
    # Priority 0 outranks nobody; the victims are still there.
    assert second["status"] == "Unschedulable" and second["preempt"] is None
    assert "would preempt" not in second["reason"]
    code, lines, _ = _run(capsys, *args)
    assert code == 0
    assert "would preempt default/x-new on node x" in lines[1]
