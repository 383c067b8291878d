"""GRPO throughput on N GPUs: colocated (policy and vLLM share all N) vs disaggregated P policy + R rollout GPUs.

What it measures and how: bench/RESULTS.md ("How the scripts measure"). Writes <out>/results.json, <out>/<mode>.log.
GPU (2 GPUs, vLLM and ray in /tmp/site): PYTHONPATH=$PWD:/tmp/site python3 bench/rl_disaggregated.py --out /tmp/rl-bench
4 GPUs, two layouts:  ... bench/rl_disaggregated.py --gpus 4 --layouts 2+2,1+3 --out /tmp/rl-bench
CPU check of every code path:  python bench/rl_disaggregated.py --tiny --steps 3 --warmup 1 --clips 16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import harness

ROOT = harness.REPO
MODES = ("colocated", "disaggregated")
DISAGGREGATED = "disaggregated"  # mode names: disaggregated-P+R, one per layout
RAY_TMP = "/tmp/ray-rl-bench"  # short: Ray's socket paths must stay under 107 characters
PROBE_TIMEOUT_S = 120.0
PROBE_ROUNDS = 4  # the first sets the channel up and is not counted
# Set in every process this bench starts: NVLink multicast must stay off on the shared GPU hosts, and the
# model is local (no hub look-ups on a machine without internet).
BASE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
# NCCL between two processes that each see only their own GPU, without CUDA IPC (some VMs block it).
NCCL_SOCKET_ONLY = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def build_model(folder: Path, tiny: bool) -> Path:
    """The 3B-shape random model of bench/shapes.py (or the tiny one), written once under `folder`, in a child process
    (memory this process kept cached on the GPU would be missing to the modes' vLLM engines)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--build-model", str(folder)]
    subprocess.run(command + (["--tiny"] if tiny else []), check=True)
    return folder


def build_model_child(folder: Path, tiny: bool) -> None:
    from shapes import build_model_folder

    build_model_folder(folder, "qwen2.5-vl-3b", tiny)


def build_data(folder: Path, count: int, workers: int) -> Path:
    """`count` arrow-of-time clips with their multiple-choice records (kept between runs)."""
    data = folder / "arrow_of_time" / "arrow_of_time_benchmark_qa_pairs.json"
    if not data.is_file() or len(json.loads(data.read_text())) < count:
        subprocess.run([sys.executable, "-m", "physreason", "data", "synth", "--task", "arrow_of_time", "--n",
                        str(count), "--out", str(folder), "--workers", str(workers), "--no-progress"],
                       check=True)  # fmt: skip
    return data


def parse_layouts(text: str | None, gpus: int) -> list[tuple[int, int]]:
    """--layouts "2+2,1+3" as [(policy GPUs, rollout replicas)]; None: half the GPUs each side (1+1 on 2 GPUs).

    SystemExit (exit code 2) naming the layout when it is malformed or its GPUs do not add up to `gpus`.
    """
    if text is None:
        return [(max(gpus // 2, 1), max(gpus - gpus // 2, 1))]
    layouts = []
    for item in text.split(","):
        policy, _, rollout = item.strip().partition("+")
        if not (policy.isdigit() and rollout.isdigit()) or int(policy) < 1 or int(rollout) < 1:
            usage_error(f"--layouts: {item.strip()!r} is not P+R (policy GPUs + rollout replicas, each >= 1), e.g. 2+2")
        if int(policy) + int(rollout) != gpus:
            usage_error(f"--layouts: {item.strip()} uses {int(policy) + int(rollout)} GPUs but --gpus is {gpus}: "
                        "make P+R equal --gpus (or change --gpus)")  # fmt: skip
        layouts.append((int(policy), int(rollout)))
    return layouts


def usage_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_time_share(modes: list[str], time_limit: float, min_mode_s: float) -> None:
    """Refuse a --time-limit that gives each mode less than --min-mode-s: modes run one after another and each gets an
    even share of what is left, so a share too short for a mode's start and steps loses every mode's table row."""
    share = time_limit / max(len(modes), 1)
    if share < min_mode_s:
        usage_error(
            f"--time-limit {time_limit:g} s over {len(modes)} modes ({', '.join(modes)}) gives each about {share:.0f} s, "
            f"below --min-mode-s {min_mode_s:g}: run one mode a call (--modes colocated, or --modes disaggregated "
            "--layouts P+R; --append keeps earlier rows), raise --time-limit or lower --min-mode-s"
        )


def layout_mode(policy: int, rollout: int) -> str:
    return f"{DISAGGREGATED}-{policy}+{rollout}"


def mode_layout(mode: str) -> tuple[int, int] | None:
    """(policy GPUs, rollout replicas) of a disaggregated-P+R mode; None for colocated."""
    if not mode.startswith(DISAGGREGATED + "-"):
        return None
    policy, rollout = mode.removeprefix(DISAGGREGATED + "-").split("+")
    return int(policy), int(rollout)


def batch_shape(tiny: bool, prompts: int | None = None) -> tuple[int, int]:
    """(prompts, completions each) of one step: 8 x 8 = 64 completions on GPUs, 4 x 4 with --tiny; `prompts`
    (--prompts) replaces the first, e.g. 12 so that 3 policy GPUs split them (layout 3+1)."""
    default, n = (4, 4) if tiny else (8, 8)
    return prompts or default, n


def check_divisible(
    layouts: list[tuple[int, int]], gpus: int, tiny: bool, modes: list[str], prompts: int | None = None
) -> None:
    """Every data-parallel world (colocated: --gpus ranks; a layout: P policy ranks) must split the step's prompts."""
    prompts, _ = batch_shape(tiny, prompts)
    worlds = ([("colocated", gpus)] if "colocated" in modes else []) + [(layout_mode(p, r), p) for p, r in layouts]
    for mode, world in worlds:
        if prompts % world:
            usage_error(f"{mode}: {world} policy ranks do not split the step's {prompts} prompt groups evenly: "
                        f"use a number of policy GPUs that divides {prompts}, or --prompts")  # fmt: skip


def recipe(model: Path, data: Path, out: Path, mode: str, args: argparse.Namespace) -> dict:
    """The GRPO recipe of one mode; every mode trains the same batches, only the placement differs.

    disaggregated-P+R: the policy is one FSDP replica over exactly P ranks (dp_shard_size P) and R rollout replicas of
    tp 1 each, so the controller asks for P + R GPUs.
    """
    gpu = not args.tiny
    prompts, n = batch_shape(args.tiny, args.prompts)
    layout = mode_layout(mode)
    policy_gpus, rollout_replicas = layout if layout else (-1, 1)
    # Colocated, vLLM sits beside an FSDP shard of the policy (fp32 masters and AdamW: about 30 GB per GPU).
    engine_memory = 0.3 if mode == "colocated" else 0.85
    return {
        "model": {"model_name_or_path": str(model), "model_max_length": 4096, "dtype": "bfloat16" if gpu else "float32"},
        "engine": {"backend": args.engine, "gpu_memory_utilization": engine_memory, "max_model_len": 4096,
                   "batch_size": prompts * n},
        "vision": {"fps": 4.0 if gpu else 2.0, "max_frames": 32 if gpu else 4},
        "data": {"dataset": {"name": str(data)}, "num_workers": 0},
        "train": {"output_dir": str(out / mode), "max_steps": args.steps, "train_batch_per_replica": prompts * n,
                  "param_dtype": "bfloat16" if gpu else "float32", "gradient_checkpointing": gpu, "log_freq": 1,
                  "ckpt": {"enable_checkpoint": False}},
        "rollout": {"n_generation": n, "max_response_length": args.response_len, "batch_size": prompts,
                    "sampling_config": {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0},
                    "parallelism": {"n_init_replicas": rollout_replicas, "tp_size": 1}},
        "policy": {"parallelism": {"dp_shard_size": policy_gpus}},
        "grpo": {"mode": DISAGGREGATED if layout else "colocated", "allowed_outdated_steps": 1, "mini_batch": 8},
        "logging": {"logger": ["jsonl"]},
    }  # fmt: skip


class GPUSampler:
    """Each GPU's utilization (%) from nvidia-smi every 200 ms, read by a background thread; no samples without nvidia-smi."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, dict[int, int]]] = []
        self._proc: subprocess.Popen | None = None
        if shutil.which("nvidia-smi") is None:
            return
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        row: dict[int, int] = {}
        for line in self._proc.stdout:
            fields = [f.strip() for f in line.split(",")]
            if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit():
                continue  # "[N/A]" or a warning line
            index, util = int(fields[0]), int(fields[1])
            if index in row:  # a new sweep over the GPUs begins
                self.samples.append((time.time(), row))
                row = {}
            row[index] = util

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()

    def summary(self, start: float, end: float) -> dict[str, list[float] | None]:
        """Per GPU over [start, end]: the fraction of samples below 5% utilization and the mean utilization (%)."""
        window = [row for t, row in self.samples if start <= t <= end]
        if not window:
            return {"idle_fraction": None, "mean_util": None}
        gpus = sorted(window[0])
        return {
            "idle_fraction": [sum(r.get(g, 0) < 5 for r in window) / len(window) for g in gpus],
            "mean_util": [sum(r.get(g, 0) for r in window) / len(window) for g in gpus],
        }


# ---- children -------------------------------------------------------------------------------------------------------


def run_colocated(config) -> None:
    """One torchrun rank of colocated GRPO; with vLLM, this rank's engine runs on this rank's GPU."""
    import torch.distributed as dist

    from physreason.train.grpo import run_grpo
    from physreason.train.runtime import init_runtime

    runtime = init_runtime()  # joins torchrun's group before vLLM looks for one
    engine = None
    if config.engine.backend == "vllm" and runtime.world_size > 1:
        from physreason.engines.vllm import VLLMEngine

        engine = VLLMEngine(config.model, config.engine)  # under torchrun: each rank's engine on its own GPU
    run_grpo(config, engine)
    if engine is not None:
        from physreason import vllm_compat

        vllm_compat.release_distributed()  # vLLM's groups live inside torchrun's: they go first
    if dist.is_initialized():
        dist.destroy_process_group()


class ProbeEnd:
    """One end of a probe weight channel, run as a one-GPU Ray actor: rank 0 hosts the store and sends."""

    def address(self) -> tuple[str, int]:
        import torch.distributed as dist

        from physreason.distributed.policy_worker import node_address
        from physreason.distributed.weight_transfer import CHANNEL_TIMEOUT

        self.store = dist.TCPStore(node_address(), 0, is_master=True, wait_for_workers=False, timeout=CHANNEL_TIMEOUT)
        return node_address(), self.store.port

    def transfer(self, host: str, port: int, rank: int, nbytes: int, bucket_bytes: int) -> dict[str, Any]:
        """Send (rank 0) or receive into GPU staging and check (rank 1) `nbytes` of 64 MiB tensors in buckets of
        `bucket_bytes`, as a weight push does, PROBE_ROUNDS times; the seconds of all but the first round (set-up)."""
        import ray
        import torch

        from physreason.distributed import weight_transfer as transfer

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        piece = min(64 << 20, nbytes)
        specs = [transfer.TensorSpec(f"probe{i}", (piece,), torch.uint8) for i in range(nbytes // piece)]
        buckets = transfer.plan_buckets(specs, bucket_bytes)
        channel = transfer.WeightChannel(host, port, "probe", rank, device, store=self.store if rank == 0 else None)
        pattern = torch.arange(251, dtype=torch.uint8, device=device).repeat(-(-piece // 251))[:piece]  # [piece]
        staging = transfer.StagingArea(buckets, device) if rank == 1 else None
        seconds = []
        for round_ in range(PROBE_ROUNDS):
            started = time.perf_counter()
            if rank == 0:
                transfer.send_transfer({0: channel}, round_, buckets, ((s.name, pattern) for s in specs), device)
            else:
                version, tensors = channel.receive(buckets, staging)
                if version != round_ or not all(torch.equal(t, pattern) for _, t in tensors):
                    raise RuntimeError(f"probe round {round_} arrived corrupted")
            seconds.append(time.perf_counter() - started)
        return {"seconds": seconds[1:], "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip


def probe_weight_channel(ray, nbytes: int, bucket_bytes: int) -> dict[str, Any]:
    """Push `nbytes` between two one-GPU actors over a WeightChannel; raises on failure or after PROBE_TIMEOUT_S."""
    end = ray.remote(num_cpus=0, num_gpus=1)(ProbeEnd)
    sender, receiver = end.remote(), end.remote()
    try:
        host, port = ray.get(sender.address.remote(), timeout=PROBE_TIMEOUT_S)
        refs = [actor.transfer.remote(host, port, rank, nbytes, bucket_bytes)
                for rank, actor in enumerate((sender, receiver))]  # fmt: skip
        done, _ = ray.wait(refs, num_returns=2, timeout=PROBE_TIMEOUT_S)
        if len(done) < 2:
            raise TimeoutError(f"the probe transfer did not finish in {PROBE_TIMEOUT_S:.0f} s")
        sent, received = ray.get(refs)
    finally:
        ray.kill(sender)
        ray.kill(receiver)
    seconds = [max(a, b) for a, b in zip(sent["seconds"], received["seconds"], strict=True)]
    return {"bytes": nbytes, "bucket_bytes": bucket_bytes, "seconds": seconds,
            "gbytes_per_s": nbytes / min(seconds) / 1e9, "sender_gpus": sent["gpu_ids"],
            "receiver_gpus": received["gpu_ids"],
            "cuda_visible_devices": [sent["cuda_visible_devices"], received["cuda_visible_devices"]]}  # fmt: skip


def actor_env(extra: dict[str, str]) -> dict[str, str]:
    """Environment of every Ray actor: this process's PYTHONPATH (vLLM in /tmp/site) and CUDA_HOME, BASE_ENV, NCCL_*."""
    env = {key: value for key, value in os.environ.items() if key.startswith("NCCL_")}
    env.update(BASE_ENV)
    env["PYTHONPATH"] = harness.child_env()["PYTHONPATH"]
    cuda_home = os.environ.get("CUDA_HOME") or ("/usr/local/cuda" if Path("/usr/local/cuda").is_dir() else None)
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
    env.update(extra)
    return env


def start_ray(ray, gpus: int, extra: dict[str, str]) -> None:
    import torch

    # Ray's memory monitor reads MemTotal, which on the GPU VMs starts far below the real limit and grows with use.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    # num_gpus on a CPU machine: logical GPUs, so placement by num_gpus runs as it does on GPUs
    ray.init(num_cpus=max(4, os.cpu_count() or 1), num_gpus=gpus, include_dashboard=False, _temp_dir=RAY_TMP,
             runtime_env={"env_vars": actor_env(extra)})  # fmt: skip
    print(f"ray: {ray.cluster_resources()}, torch sees {torch.cuda.device_count()} GPU(s)", flush=True)


def run_disaggregated_child(config, gpus: int, probe_path: Path, kill_at: int = 0) -> None:
    """The Ray driver: probe the weight channel (falling back to socket-only NCCL), then run disaggregated GRPO;
    kill_at > 0 kills the first ready rollout replica after that step. Events, handed-back prompts: <config>.run.json."""
    import ray
    import torch

    from physreason.distributed.controller import run_disaggregated

    use_gpu = torch.cuda.is_available()
    attempts: list[dict[str, Any]] = []
    for extra in ({}, NCCL_SOCKET_ONLY) if use_gpu else ({},):
        start_ray(ray, gpus, extra)
        try:
            probe = (4 << 30, 1 << 30) if use_gpu else (64 << 20, 16 << 20)  # (bytes, bucket bytes)
            attempts.append({"env": extra, **probe_weight_channel(ray, *probe)})
            break
        except Exception as exc:  # noqa: BLE001 - any failure of the probe means: try the next transport
            attempts.append({"env": extra, "error": f"{type(exc).__name__}: {exc}"})
            print(f"weight channel probe failed with {extra or 'default NCCL settings'}: {exc}", flush=True)
            ray.shutdown()
    probe_path.write_text(json.dumps(attempts, indent=2))
    if "error" in attempts[-1]:
        raise SystemExit("the weight channel probe failed with every NCCL setting; see " + str(probe_path))
    print(f"weight channel probe: {attempts[-1]}", flush=True)
    killed: list[dict[str, Any]] = []

    def kill_when_generating(controller, victim: int, step: int) -> None:
        # Polls the controller's record (read only) from this thread: the controller hands out work after on_step.
        replica = controller.replicas.get(victim)
        deadline = time.monotonic() + 60.0
        while replica is not None and replica.generating is None and time.monotonic() < deadline:
            time.sleep(0.02)
        busy = replica is not None and replica.generating is not None
        ray.kill(replica.handle if replica is not None else controller.rollout_handle(victim), no_restart=True)
        killed.append({"replica": victim, "after_step": step, "busy": busy})
        print(f"killed rollout replica {victim} after step {step} ({'generating' if busy else 'idle'})", flush=True)

    def chaos(controller, step: int) -> None:
        ready = controller.ready_replicas()
        if kill_at and step == kill_at and ready and not killed:
            threading.Thread(target=kill_when_generating, args=(controller, ready[0], step), daemon=True).start()

    try:
        result = run_disaggregated(config, on_step=chaos)
        for event in result.events:
            print(event, flush=True)
        probe_path.with_name(probe_path.name.replace(".probe.json", ".run.json")).write_text(json.dumps({
            "killed": killed, "events": result.events, "redrawn": [draw for _, draw in result.redrawn],
            "redispatched": [draw for before, draw in result.redrawn
                             if any(draw in call for call in result.dispatched[before:])],
        }, indent=2))
    finally:
        ray.shutdown()


def run_child(mode: str, config_path: Path, gpus: int, kill_at: int = 0) -> None:
    """Child process: one GRPO run in `mode`."""
    import logging

    from physreason.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(config_path, [])
    if mode == "colocated":
        run_colocated(config)
    else:
        run_disaggregated_child(config, gpus, config_path.with_suffix(".probe.json"), kill_at)


# ---- parent ---------------------------------------------------------------------------------------------------------


def run_status(code: int | None, logged: int, wanted: int) -> str:
    """A mode's outcome: its exit code, or (killed at its time share: code None) whether every step was logged first."""
    if code is None:
        return "all steps, then killed at exit" if logged >= wanted else "timed out"
    return "ok" if code == 0 else f"exit code {code}"


def measure(mode: str, config: dict, out: Path, args: argparse.Namespace, timeout_s: float) -> dict[str, Any]:
    """Run one mode as a child process under the GPU sampler and summarise its logged steps."""
    from physreason.config import Config, dump_config

    config_path = out / f"{mode}.toml"
    dump_config(Config.model_validate(config), config_path)
    metrics_path = out / mode / "logs" / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    child = [str(Path(__file__).resolve()), "--child", mode, str(config_path), "--gpus", str(args.gpus),
             "--kill-rollout-at", str(args.kill_rollout_at)]
    if mode == "colocated":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
                   *child]  # fmt: skip
    else:
        command = [sys.executable, *child]
    print(f"{mode}: {' '.join(command)} (limit {timeout_s:.0f} s, log {out / f'{mode}.log'})", flush=True)
    sampler = GPUSampler()
    started = time.time()
    code = harness.run_logged(command, out / f"{mode}.log", timeout_s, cwd=ROOT)
    sampler.stop()
    lines = [json.loads(line) for line in metrics_path.open()] if metrics_path.is_file() else []
    status = run_status(code, len(lines), args.steps)
    layout = mode_layout(mode)
    result: dict[str, Any] = {"mode": mode, "status": status, "steps_logged": len(lines), "steps_wanted": args.steps,
                              "wall_s": time.time() - started, "gpus": args.gpus,
                              "layout": f"{layout[0]}+{layout[1]}" if layout else f"{args.gpus} shared",
                              "policy_gpus": layout[0] if layout else args.gpus,
                              "rollout_replicas": layout[1] if layout else args.gpus}  # fmt: skip
    if layout and config_path.with_suffix(".probe.json").is_file():
        result["weight_channel_probe"] = json.loads(config_path.with_suffix(".probe.json").read_text())
    if layout and config_path.with_suffix(".run.json").is_file():
        run = json.loads(config_path.with_suffix(".run.json").read_text())
        result.update({"killed": run["killed"], "redrawn": run["redrawn"], "redispatched": run["redispatched"],
                       "replicas_lost": sum(" lost (" in e for e in run["events"])})
    if status != "ok":
        tail = (out / f"{mode}.log").read_text(errors="replace").splitlines()[-40:]
        print(f"{mode}: {status}; last lines of its log:\n" + "\n".join(tail), flush=True)
    if lines:
        result["startup_s"] = lines[0]["time"] - lines[0]["time/step_s"] - started
    measured = lines[args.warmup :]
    if not measured:
        return result
    window_start = lines[args.warmup - 1]["time"] if args.warmup else lines[0]["time"] - lines[0]["time/step_s"]
    window_end = measured[-1]["time"]
    completions = len(measured) * config["train"]["train_batch_per_replica"]
    result.update({
        "steps": len(measured),
        "samples_per_s": completions / (window_end - window_start),
        "step_s_mean": (window_end - window_start) / len(measured),
        **{f"gpu_{k}": v for k, v in sampler.summary(window_start, window_end).items()},
        "reward_mean": sum(m["reward/total_mean"] for m in measured) / len(measured),
        "response_length_mean": sum(m.get("rollout/response_length_mean", 0.0) for m in measured) / len(measured),
    })
    result["sync_s_mean"] = sum(m["time/sync_s"] for m in measured) / len(measured)
    if layout:
        # Each side's idle share as the controller times it (policy: updates, pushes, saves; rollout: loads, generates).
        for key in ("rollout/staleness_mean", "time/policy_idle_frac", "time/rollout_idle_frac"):
            result[key.split("/")[1]] = sum(m[key] for m in measured) / len(measured)
        pushes = [m for m in measured if m.get("time/publish_s", 0.0) > 0]
        if pushes:
            result["push_s_mean"] = sum(m["time/publish_s"] for m in pushes) / len(pushes)
            result["push_gbytes_per_s"] = sum(m["sync/gbytes_per_s"] for m in pushes) / len(pushes)
    return result


def markdown(results: list[dict[str, Any]]) -> str:
    """The results as rows of a markdown table (n/a where a mode has no such figure)."""

    def pct(values: list[float] | None, gpu: int) -> str:
        return f"{values[gpu]:.0%}" if values and gpu < len(values) else "n/a"

    def per_gpu(values: list[float] | None) -> str:
        return " ".join(f"{v:.0%}" for v in values) if values else "n/a"

    def num(value: float | None, spec: str) -> str:
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    rows = [
        "| mode | policy+rollout GPUs | status | steps | samples/s | step s | idle per GPU | util per GPU | "
        "policy idle | rollout idle | sync s | push GB/s | staleness | start-up s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []  # after the table, so that its rows stay one markdown table
    for r in results:
        util = [u / 100 for u in r["gpu_mean_util"]] if r.get("gpu_mean_util") else None
        rows.append(
            f"| {r['mode']} | {r.get('layout', 'n/a')} | {r['status']} | {r.get('steps', 0)} | "
            f"{num(r.get('samples_per_s'), '.2f')} | {num(r.get('step_s_mean'), '.2f')} | "
            f"{per_gpu(r.get('gpu_idle_fraction'))} | {per_gpu(util)} | "
            f"{pct([r['policy_idle_frac']] if 'policy_idle_frac' in r else None, 0)} | "
            f"{pct([r['rollout_idle_frac']] if 'rollout_idle_frac' in r else None, 0)} | "
            f"{num(r.get('sync_s_mean'), '.3f')} | {num(r.get('push_gbytes_per_s'), '.3g')} | "
            f"{num(r.get('staleness_mean'), '.2f')} | {num(r.get('startup_s'), '.0f')} |"
        )
        for attempt in r.get("weight_channel_probe", []):
            if "gbytes_per_s" in attempt:
                notes.append(
                    f"\n{r['mode']}: weight channel probe ({attempt['env'] or 'default settings'}): {attempt['bytes'] / 2**20:.0f} MiB "
                    f"in {attempt['bucket_bytes'] / 2**20:.0f} MiB buckets, best {attempt['gbytes_per_s']:.3g} GB/s "
                    f"(rounds: {', '.join(f'{t:.3f}' for t in attempt['seconds'])} s)"
                )
        if r.get("killed"):
            kill = r["killed"][0]
            notes.append(
                f"\n{r['mode']}: rollout replica {kill['replica']} killed after step {kill['after_step']} "
                f"({'generating' if kill['busy'] else 'idle'}): {r['steps_logged']} of {r['steps_wanted']} steps logged, "
                f"{len(r['redrawn'])} prompt(s) handed back, {len(r['redispatched'])} of them handed out again"
            )
    rates = {r["mode"]: r.get("samples_per_s") for r in results}
    for mode, rate in rates.items():
        if mode_layout(mode) and rate and rates.get("colocated"):
            notes.append(f"\n{mode} / colocated samples/s: {rate / rates['colocated']:.2f}x")
    return "\n".join(rows + notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/rl-bench"), help="work folder (model, data, runs)")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps per mode, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the measurement")
    parser.add_argument("--clips", type=int, default=96, help="arrow-of-time clips (prompts; drawn again after an epoch)")
    parser.add_argument("--response-len", type=int, default=256, help="most new tokens per completion")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=None, help="prompts a step (8, 4 with --tiny; 8 completions "
                        "each, 4 with --tiny): every mode's policy ranks must divide it, e.g. 12 for 3+1 beside colocated")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="disaggregated: one run per --layouts entry")
    parser.add_argument("--layouts", default=None, metavar="P+R[,P+R...]",
                        help="disaggregated layouts: P policy GPUs (one FSDP replica) + R rollout replicas (tp 1), "
                        "P+R = --gpus each, e.g. 2+2,1+3 with --gpus 4; default: half each side (1+1 on 2 GPUs)")
    parser.add_argument("--engine", choices=["vllm", "hf"], default=None, help="default: vllm, hf with --tiny")
    parser.add_argument("--tiny", action="store_true", help="tiny model and shapes on CPU: checks every code path")
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds for everything; modes share what is left")
    parser.add_argument("--min-mode-s", type=float, default=None,
                        help="refuse a --time-limit whose share per mode is below this (default 240 s; 0 with --tiny): "
                        "a 3B mode's start and steps did not fit 183 s a mode")  # fmt: skip
    parser.add_argument("--synth-workers", type=int, default=8)
    parser.add_argument("--kill-rollout-at", type=int, default=0, metavar="STEP",
                        help="disaggregated: after this step, kill a rollout replica (its Ray actor) once it is "
                        "generating (within 60 s); 0: none")
    parser.add_argument("--append", action="store_true",
                        help="keep the results of other modes already in <out>/results.json (an earlier call on the "
                        "same machine) in the table and the ratios; modes run now replace theirs")  # fmt: skip
    parser.add_argument("--child", nargs=2, metavar=("MODE", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--build-model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    for key, value in BASE_ENV.items():
        os.environ.setdefault(key, value)
    if args.child:
        run_child(args.child[0], Path(args.child[1]), args.gpus, args.kill_rollout_at)
        return
    if args.build_model:
        build_model_child(args.build_model, args.tiny)
        return
    layouts = parse_layouts(args.layouts, args.gpus)
    if args.prompts is not None and args.prompts < 1:
        usage_error(f"--prompts {args.prompts}: give at least 1")
    check_divisible(layouts, args.gpus, args.tiny, args.modes, args.prompts)
    modes = [m for mode in args.modes for m in ([mode] if mode == "colocated" else [layout_mode(*x) for x in layouts])]
    check_time_share(modes, args.time_limit, args.min_mode_s if args.min_mode_s is not None else 0 if args.tiny else 240)
    deadline = time.time() + args.time_limit
    args.engine = args.engine or ("hf" if args.tiny else "vllm")
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise SystemExit("vLLM is not importable: put it on PYTHONPATH (e.g. /tmp/site) or pass --engine hf")
    if "disaggregated" in args.modes and importlib.util.find_spec("ray") is None:
        raise SystemExit("ray is not importable: put it on PYTHONPATH (e.g. /tmp/site)")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = harness.child_env()["PYTHONPATH"]
    prompts, n = batch_shape(args.tiny, args.prompts)
    info = harness.device_line(engine=args.engine, prompts=prompts, completions_each=n)
    started = time.time()
    model = build_model(args.out / ("model-tiny" if args.tiny else "model-3b"), args.tiny)
    data = build_data(args.out / "data", args.clips, args.synth_workers)
    print(f"model and data ready in {time.time() - started:.0f} s", flush=True)
    earlier = args.out / "results.json"
    kept = json.loads(earlier.read_text()) if args.append and earlier.is_file() else []
    default_prompts = batch_shape(args.tiny)[0]  # results from before --prompts have no "prompts" key
    if other := sorted({r.get("prompts", default_prompts) for r in kept} - {prompts}):
        usage_error(f"--append: {earlier} holds runs of {other} prompts a step, this run {prompts}: use another --out")
    results = [r for r in kept if r["mode"] not in modes]
    for i, mode in enumerate(modes):
        timeout_s = (deadline - time.time()) / (len(modes) - i)
        result = measure(mode, recipe(model, data, args.out, mode, args), args.out, args, timeout_s)
        results.append({**result, "prompts": prompts, "completions_each": n})
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
        harness.write_json("rl_disaggregated.json", {**info, "results": results})
    print(markdown(results))


if __name__ == "__main__":
    main()
