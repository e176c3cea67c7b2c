"""Policy latency: torch vs onnxruntime on the shipped (Nature-CNN) architecture, CPU.

    .venv/bin/python benchmarks/onnx_latency.py [--checkpoint agent.pt] [--batches 1 8]
        [--repeats 7] [--calls 50] [--threads N]

Exports the checkpoint (default: a freshly initialised Pong model with the default
architecture) with `export_onnx`, then times `get_logits` in torch and the exported graph
in onnxruntime on the same real Pong frames, side by side: each round runs `--calls`
calls of torch, then of onnxruntime, per batch size. It prints the median over rounds of
the mean time per call (one call = one batch).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from oakemu_rl.agents.onnx import INPUT_NAME, OUTPUT_NAME, default_threads, load_onnx_agent
from oakemu_rl.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
from oakemu_rl.export import collect_observations, export_onnx
from oakemu_rl.model import PPOModel, parameter_count


def fresh_checkpoint(path: Path) -> Path:
    spec = EnvSpec(game="pong")
    meanings = list(action_meanings(spec.game))
    torch.manual_seed(0)
    model = PPOModel(spec.observation_shape, len(meanings))
    checkpoint = Checkpoint.from_model(model, stage="scratch", action_meanings=meanings,
                                       action_mask=action_mask(spec).tolist(),
                                       env_spec=spec.to_dict())
    return save_checkpoint(path, checkpoint)


def per_call_ms(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1000.0 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both runtimes (default: onnxruntime's default for "
                             "this machine, and torch gets the same)")
    args = parser.parse_args()

    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as folder:
        source = args.checkpoint or fresh_checkpoint(Path(folder) / "agent.pt")
        report = export_onnx(source, Path(folder) / "agent.onnx", verify_frames=16)
        agent, spec = load_onnx_agent(report.path, threads=threads)
        model = load_checkpoint(source).build_model("cpu").eval()
    frames = collect_observations(spec, max(args.batches), seed=0)
    print(f"{spec.env_id}, observations {spec.observation_shape} uint8, "
          f"{parameter_count(model):,} parameters, ONNX file {report.bytes / 2**20:.1f} MiB")
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads) vs onnxruntime "
          f"{__import__('onnxruntime').__version__} "
          f"({agent.session.get_session_options().intra_op_num_threads} intra-op threads); "
          f"{report.summary()}")
    print(f"median over {args.repeats} rounds of {args.calls} calls, ms per batch:")
    print(f"{'batch':>5}  {'torch':>9}  {'onnxruntime':>11}  {'torch/ort':>9}")

    session = agent.session
    for batch in args.batches:
        x_np = np.ascontiguousarray(frames[:batch])
        x_torch = torch.from_numpy(x_np)

        def run_torch(x=x_torch) -> None:
            with torch.inference_mode():
                model.get_logits(x)

        def run_ort(x=x_np) -> None:
            session.run([OUTPUT_NAME], {INPUT_NAME: x})

        for fn in (run_torch, run_ort):  # warm-up: allocators, kernels, caches
            per_call_ms(fn, max(5, args.calls // 5))
        torch_ms, ort_ms = [], []
        for _ in range(args.repeats):
            torch_ms.append(per_call_ms(run_torch, args.calls))
            ort_ms.append(per_call_ms(run_ort, args.calls))
        t, o = statistics.median(torch_ms), statistics.median(ort_ms)
        print(f"{batch:>5}  {t:>9.3f}  {o:>11.3f}  {t / o:>8.2f}x")


if __name__ == "__main__":
    main()
