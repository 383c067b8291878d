"""The host's AdamW step under CPU offload (train.cpu_offload): torch's fused CPU AdamW, as physreason steps it, against
torch's default CPU AdamW and DeepSpeed's CPU Adam (the anchor issue #46 names), on the same tensors and threads.

Under CPU offload the optimizer step runs on the host over every fp32 master, gradient and moment: at the
Qwen2.5-VL-3B shape it was 2.35 s of a 3.13 s step (bench/RESULTS.md). This measures that step alone, on tensors of
the 3B decoder's shapes (fp32 weights, gradients and moments; --elements in all), for each implementation:

- `fused`: torch.optim.AdamW(fused=True), physreason's host step (train.schedule.fused_adamw);
- `fused-clip`: the same with the clip coefficient as the kernel's grad_scale, as parallelize.clip_and_step steps
  when the gradient norm is above train.max_grad_norm (it also writes the clipped gradient back: 4 bytes more);
- `default`: torch.optim.AdamW() left to its default on CPU tensors (its single-tensor path);
- `deepspeed`: deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True) when deepspeed is installed and its op builds
  (a row saying why not otherwise).

Each row: median seconds a step over --steps after --warmup, nanoseconds an element, GB/s at the bytes the update
must move (28 an element: read weight, gradient and two moments, write weight and moments; 32 for fused-clip), the
speed against `fused` from the same run, and the largest difference of the weights after the same steps from
`fused`'s (relative to the largest weight; fused-clip's against fused on the halved gradients the clip leaves): a
faster step that computes something else shows here. Threads: torch's
(torch.set_num_threads, --threads); DeepSpeed's kernels use OpenMP's own count (OMP_NUM_THREADS), printed beside.

    python bench/host_adamw.py --elements 200e6 --steps 5
    python bench/host_adamw.py --impls fused deepspeed --threads 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import harness
import torch

# The Qwen2.5-VL-3B decoder block's tensors (hidden 2048, MLP 11008): q, k, v, o, gate, up, down, two norms, biases.
BLOCK = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (11008, 2048), (11008, 2048), (2048, 11008), (2048,),
         (2048,), (2048,), (256,), (256,)]  # fmt: skip
IMPLS = ("fused", "fused-clip", "default", "deepspeed")
BYTES = {"fused": 28, "fused-clip": 32, "default": 28, "deepspeed": 28}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.1
CLIP_DIVISOR = 2.0


def shapes_for(elements: int) -> list[tuple[int, ...]]:
    """Whole and partial 3B blocks' tensor shapes adding up to about `elements` (at least one tensor)."""
    shapes: list[tuple[int, ...]] = []
    total = 0
    while total < elements:
        for shape in BLOCK:
            size = 1
            for side in shape:
                size *= side
            if shapes and total + size > elements:
                return shapes
            shapes.append(shape)
            total += size
    return shapes


def make_params(shapes: list[tuple[int, ...]], seed: int, grad_factor: float = 1.0) -> list[torch.nn.Parameter]:
    """fp32 parameters with fp32 gradients (times `grad_factor`), the same values for every implementation (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02)
        param.grad = torch.randn(shape, generator=generator) * (1e-3 * grad_factor)
        params.append(param)
    return params


def deepspeed_adam():
    """DeepSpeed's CPUAdam class, or the reason it cannot run here (str)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or its import fails without an accelerator it knows
        return f"deepspeed not importable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return DeepSpeedCPUAdam


def build(impl: str, params: list[torch.nn.Parameter]):
    """(optimizer, step) for `impl`; step() runs one optimizer step."""
    kwargs = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    if impl in ("fused", "fused-clip"):
        optimizer = torch.optim.AdamW(params, fused=True, **kwargs)
        if impl == "fused":
            return optimizer, optimizer.step
        scale = torch.tensor(CLIP_DIVISOR)  # clip_and_step's divisor for a norm twice train.max_grad_norm

        def clipped() -> None:
            optimizer.grad_scale = scale
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale

        return optimizer, clipped
    if impl == "default":
        optimizer = torch.optim.AdamW(params, **kwargs)
        return optimizer, optimizer.step
    cls = deepspeed_adam()
    if isinstance(cls, str):
        raise RuntimeError(cls)
    optimizer = cls(params, adamw_mode=True, fp32_optimizer_states=True, **kwargs)
    return optimizer, optimizer.step


def run_impl(
    impl: str, shapes: list[tuple[int, ...]], warmup: int, steps: int, grad_factor: float = 1.0
) -> tuple[list[float], torch.Tensor]:
    """Seconds of each timed step, and the weights after warmup + steps steps (flattened, for the comparison)."""
    params = make_params(shapes, seed=0, grad_factor=grad_factor)
    optimizer, step = build(impl, params)
    if impl == "fused-clip":  # its gradients are rewritten by each step: keep them as they were for the next
        grads = [p.grad.clone() for p in params]
    times = []
    with torch.no_grad():
        for index in range(warmup + steps):
            started = time.perf_counter()
            step()
            if index >= warmup:
                times.append(time.perf_counter() - started)
            if impl == "fused-clip":
                for param, grad in zip(params, grads, strict=True):
                    param.grad.copy_(grad)
        weights = torch.cat([p.detach().reshape(-1) for p in params])
    del optimizer, params
    return times, weights


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=float, default=100e6, help="fp32 elements stepped (the 3B has 3.75e9)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own count)")
    harness.add_steps(parser, 5, 1)
    harness.add_json(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "fused" not in args.impls:
        args.impls = ["fused", *args.impls]  # the baseline of every ratio, from the same run
    shapes = shapes_for(int(args.elements))
    elements = sum(torch.Size(s).numel() for s in shapes)
    info = harness.device_line(torch.device("cpu"), cpu_threads=torch.get_num_threads(),
                               omp_num_threads=os.environ.get("OMP_NUM_THREADS", "unset"), cores=os.cpu_count(),
                               elements=elements, tensors=len(shapes))  # fmt: skip
    report = harness.Report("host_adamw.json", args.json, **info, versions=harness.versions("torch", "deepspeed"))
    baseline: tuple[float, torch.Tensor] | None = None
    for impl in args.impls:
        try:
            times, weights = run_impl(impl, shapes, args.warmup, args.steps)
        except Exception as exc:  # deepspeed absent or its op failing to build: a row that says so
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            report.row(dict(impl=impl, error=message), f"{impl:>10}: not run ({message})")
            continue
        seconds = statistics.median(times)
        row = dict(impl=impl, seconds=seconds, ns_per_element=seconds / elements * 1e9,
                   gb_per_s=BYTES[impl] * elements / seconds / 1e9, times=times)  # fmt: skip
        if baseline is None:
            baseline = (seconds, weights)
        else:
            reference = baseline[1]
            if impl == "fused-clip":  # its reference: fused on the gradients the clip leaves (halved), untimed
                reference = run_impl("fused", shapes, args.warmup, args.steps, grad_factor=1 / CLIP_DIVISOR)[1]
            row["vs_fused"] = baseline[0] / seconds
            row["weights_max_rel_diff"] = float(
                (weights - reference).abs().max() / reference.abs().max().clamp(min=1e-30)
            )
        line = (f"{impl:>10}: {seconds * 1e3:9.1f} ms a step, {row['ns_per_element']:.3f} ns an element, "
                f"{row['gb_per_s']:.1f} GB/s")  # fmt: skip
        if "vs_fused" in row:
            line += f", {row['vs_fused']:.2f}x fused, weights within {row['weights_max_rel_diff']:.1e} of fused's"
        report.row(row, line)
        del weights
    return report.data


if __name__ == "__main__":
    main()
