"""Weights out: a ~100M-parameter model from a DeepSpeed learner to 1 and 2 rollout actors.

The push (``gdpo_ray.run.transports.push_weights`` over ``ObjectStoreTransport``: buckets of the
learner's parameters written once into Ray's object store, read zero-copy by every actor and
loaded into its engine) is timed until every actor generates with the new version, against one
plain memory copy of the model's bytes, and until the push is attested. Keys (``--json``):
ratio_to_memcpy_1 (aim <= 3), ratio_to_memcpy_2, two_over_one (aim < 1.5),
attested_ratio_to_memcpy_1 and _2; the same with the prefix ``broadcast_`` for the collective
path (``BroadcastTransport``: gloo). Three untimed pushes first fault in the object store's
memory (a run pays that once; the first push here costs ~1 s more).

Every push is attested (``actors.attestation``): the sender digests the copies it wrote into the
object store while the actors load them, and every actor digests what its engine holds, on a
thread, once it generates with them (``gdpo_ray.weights.digest``); the push is attested when the
driver has both and they agree. The digest pass alone is timed too, over the model's
tensors on the host, against the same memcpy: digest_s and digest_over_memcpy; and with the digest
of each tensor rounded to bfloat16 that a sender also takes for an engine holding bfloat16
(vLLM's): rounded_digest_s and rounded_digest_over_memcpy.

``--device cuda`` (a GPU machine) times instead the NCCL broadcast (``BroadcastTransport`` from a
learner on the GPU to hf engines on the GPU) to 1 and 2 actors, against one device-to-device copy
of the model's bytes: nccl_ratio_to_copy_1, nccl_ratio_to_copy_2 and nccl_two_over_one; the digest
on the device against the same copy: nccl_digest_s, nccl_digest_over_copy. On one
GPU the learner and actors share it, which NCCL allows from 2.30 on (NCCL_MULTI_RANK_GPU_ENABLE);
with an older NCCL the run reports nccl_skipped.

    python benchmarks/weight_sync.py [--json] [--layers 20] [--hidden 768] [--repeats 3] [--device cuda] [--smoke]

``--smoke``: a model of one layer of width 64, one timed push per path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WARM_PUSHES = 3  # untimed: the first pushes fault in the object store's pages (~1 s per 384 MB here), once a run
sys.path.insert(0, str(ROOT))

from benchmarks._smoke import parse_args  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the NCCL broadcast against a device-to-device copy")
    args = parse_args(parser, {"layers": 1, "hidden": 64, "repeats": 1})

    from gdpo_ray.models.tiny import build_tiny_model

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, layers=args.layers))
        results = measure_nccl(args, model) if args.device == "cuda" else measure_cpu(args, model)
    if args.json:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}
                         | {"smoke": args.smoke}))
    elif args.device == "cuda":
        print_nccl(results, args.repeats)
    else:
        print_cpu(results, args.repeats)


def rollout_group(model: str, n: int, **options):
    from actors.buffer import ArrowBuffer
    from actors.prompts import PromptSource
    from actors.rollout_group import RolloutGroup

    return RolloutGroup(dict(model_path=model, group_size=2, rewards=[{"name": "l", "fn": "length"}],
                             **options.pop("actor", {})),
                        n, PromptSource([{"prompt": "hi"}]), ArrowBuffer(groups_per_step=1), **options)


def best_of(repeats: int, run) -> float:
    """The shortest of ``repeats`` timings of ``run()`` (which returns its own seconds)."""
    return min(run() for _ in range(max(1, repeats)))


def digest_timings(tensors: list, repeats: int, sync=lambda: None) -> dict[str, float]:
    """Seconds for one digest pass over ``tensors`` (what each side of an attested push
    computes), and with the bfloat16-rounded digest a sender also takes for a bfloat16 engine."""
    from gdpo_ray.weights.digest import digest, rounded_digests

    def plain() -> float:
        sync()
        start = time.perf_counter()
        for t in tensors:
            digest(t)
        sync()
        return time.perf_counter() - start

    def rounded() -> float:
        sync()
        start = time.perf_counter()
        for t in tensors:
            digest(t)
            rounded_digests(t, "float32", ("bfloat16",))
        sync()
        return time.perf_counter() - start

    return {"digest_s": best_of(repeats, plain), "rounded_digest_s": best_of(repeats, rounded)}


def timed_pushes(transport, rollouts, version: int, args, copy) -> tuple[float, float, float, int]:
    """(best s until every actor generates with the pushed version, best s until the push is
    attested, best copy s, last version): WARM_PUSHES untimed pushes, then ``args.repeats``
    timed ones (``gdpo_ray.run.transports.push_weights``, as a run pushes), each beside one timed
    ``copy()``. The actors generate nothing meanwhile (no pump): the push alone is timed."""
    import ray

    from gdpo_ray.run.transports import push_weights

    def push(version: int) -> tuple[float, float]:
        start, attested = time.perf_counter(), rollouts.ledger.attested
        push_weights(transport, rollouts, version)
        loaded = None
        while rollouts.ledger.attested == attested:  # every report checked against the sender's digests
            if loaded is None and all(v == version for v in ray.get([s.handle.policy_version.remote()
                                                                      for s in rollouts.slots])):
                loaded = time.perf_counter() - start
            rollouts.collect()
            time.sleep(0.0005)
        done = time.perf_counter() - start
        return (done if loaded is None else loaded), done

    for _ in range(WARM_PUSHES):
        version += 1
        push(version)
    loads, attests, copies = [], [], []
    for _ in range(args.repeats):
        version += 1
        loaded, attested = push(version)
        loads.append(loaded)
        attests.append(attested)
        copies.append(copy())
    return min(loads), min(attests), min(copies), version


def measure_cpu(args, model: str) -> dict:
    """Object-store push and gloo broadcast against one host memcpy."""
    import ray
    import torch

    from gdpo_ray.run.transports import BroadcastTransport, ObjectStoreTransport
    from learners.deepspeed_learner import LearnerConfig
    from learners.learner_group import LearnerGroup

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    learners = LearnerGroup(LearnerConfig(model_path=model, zero_stage=2, digest_variants=()), num_learners=1)
    weights = learners.get_weights()
    params = sum(v.size for v in weights.values())
    model_bytes = params * 4
    source = np.ones(model_bytes, np.uint8)
    target = np.empty_like(source)

    def memcpy() -> float:
        start = time.perf_counter()
        np.copyto(target, source)
        return time.perf_counter() - start

    results: dict[str, float] = {"params_m": params / 1e6, "model_mb": model_bytes / 1e6}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the learners and actors that take the digests (training.num_threads)
    results |= digest_timings([torch.from_numpy(v.copy()) for v in weights.values()], args.repeats)
    torch.set_num_threads(threads)
    copy = best_of(args.repeats, memcpy)
    results["digest_memcpy_s"] = copy
    results["digest_over_memcpy"] = results["digest_s"] / copy
    results["rounded_digest_over_memcpy"] = results["rounded_digest_s"] / copy
    del weights
    version = 0
    for n in (1, 2):
        rollouts = rollout_group(model, n)
        ray.get([s.starting for s in rollouts.slots])
        for transport, prefix in ((ObjectStoreTransport(learners, args.bucket_mb << 20), ""),
                                  (BroadcastTransport(learners, args.bucket_mb << 20), "broadcast_")):
            push, attested, copy, version = timed_pushes(transport, rollouts, version, args, memcpy)
            results[f"{prefix}push_s_{n}"] = push
            results[f"{prefix}attested_s_{n}"] = attested
            results[f"{prefix}memcpy_s_{n}"] = copy
            results[f"{prefix}ratio_to_memcpy_{n}"] = push / copy
            results[f"{prefix}attested_ratio_to_memcpy_{n}"] = attested / copy
        rollouts.shutdown()
    learners.shutdown()
    ray.shutdown()
    results["two_over_one"] = results["push_s_2"] / results["push_s_1"]
    results["broadcast_two_over_one"] = results["broadcast_push_s_2"] / results["broadcast_push_s_1"]
    return results


def nccl_share() -> float | str:
    """Each rank's GPU fraction (whole GPUs when there are 3), or why NCCL cannot run here."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU here"
    if torch.cuda.device_count() >= 3:
        return 1.0
    version = tuple(torch.cuda.nccl.version()[:2])
    if version < (2, 30):
        return (f"{torch.cuda.device_count()} GPU(s) for 3 ranks and NCCL {version} < 2.30, which "
                "refuses two ranks on one GPU")
    return 0.25


def measure_nccl(args, model: str) -> dict:
    """NCCL broadcast (learner and hf engines on CUDA) against one device-to-device copy."""
    import ray
    import torch

    from gdpo_ray.weights.channels import MULTI_RANK_GPU_ENV
    from gdpo_ray.run.transports import BroadcastTransport
    from learners.deepspeed_learner import LearnerConfig
    from learners.learner_group import LearnerGroup

    share = nccl_share()
    if isinstance(share, str):
        return {"nccl_skipped": share}
    os.environ.setdefault(MULTI_RANK_GPU_ENV, "1")  # before Ray starts: every worker inherits it
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), MULTI_RANK_GPU_ENV: "1"}})
    learners = LearnerGroup(LearnerConfig(model_path=model, zero_stage=2, digest_variants=()), num_learners=1,
                            num_gpus_per_learner=share)
    weights = [torch.from_numpy(v.copy()).cuda() for v in learners.get_weights().values()]
    params = sum(t.numel() for t in weights)
    source = torch.ones(params * 4, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)

    def device_copy() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    results: dict = {"params_m": params / 1e6, "model_mb": params * 4 / 1e6}
    on_device = digest_timings(weights, args.repeats, torch.cuda.synchronize)
    copy = best_of(args.repeats, device_copy)
    results |= {"nccl_digest_s": on_device["digest_s"], "nccl_digest_over_copy": on_device["digest_s"] / copy,
                "nccl_rounded_digest_s": on_device["rounded_digest_s"],
                "nccl_rounded_digest_over_copy": on_device["rounded_digest_s"] / copy}
    del weights
    version = 0
    for n in (1, 2):
        rollouts = rollout_group(model, n, actor={"engine_kwargs": {"device": "cuda"}}, num_gpus=share)
        ray.get([s.starting for s in rollouts.slots])
        transport = BroadcastTransport(learners, args.bucket_mb << 20)
        push, attested, copy, version = timed_pushes(transport, rollouts, version, args, device_copy)
        if transport.backend != "nccl":
            raise SystemExit(f"the broadcast group fell back to {transport.backend}, not NCCL")
        results[f"nccl_push_s_{n}"] = push
        results[f"nccl_copy_s_{n}"] = copy
        results[f"nccl_ratio_to_copy_{n}"] = push / copy
        results[f"nccl_attested_ratio_to_copy_{n}"] = attested / copy
        rollouts.shutdown()
    learners.shutdown()
    ray.shutdown()
    results["nccl_two_over_one"] = results["nccl_push_s_2"] / results["nccl_push_s_1"]
    return results


def print_cpu(results: dict, repeats: int) -> None:
    print(f"Push of a {results['params_m']:.0f}M-parameter model ({results['model_mb']:.0f} MB fp32), "
          f"best of {repeats}:")
    for prefix, label in (("", "object store"), ("broadcast_", "gloo broadcast")):
        for n in (1, 2):
            print(f"  {label:14s} {n} actor(s): {results[f'{prefix}push_s_{n}']:.3f} s = "
                  f"{results[f'{prefix}ratio_to_memcpy_{n}']:.1f}x one memcpy of the bytes "
                  f"({results[f'{prefix}memcpy_s_{n}']:.3f} s); attested after "
                  f"{results[f'{prefix}attested_s_{n}']:.3f} s = "
                  f"{results[f'{prefix}attested_ratio_to_memcpy_{n}']:.1f}x")
        print(f"  {label:14s} 2 actors cost {results[f'{prefix}two_over_one']:.2f}x one actor (aim < 1.5)")
    print(f"  digest of every tensor (each side of an attested push): {results['digest_s']:.3f} s = "
          f"{results['digest_over_memcpy']:.1f}x one memcpy ({results['digest_memcpy_s']:.3f} s); with the "
          f"bfloat16-rounded digest too: {results['rounded_digest_s']:.3f} s = "
          f"{results['rounded_digest_over_memcpy']:.1f}x")


def print_nccl(results: dict, repeats: int) -> None:
    if "nccl_skipped" in results:
        print(f"NCCL broadcast not measured: {results['nccl_skipped']}")
        return
    print(f"NCCL broadcast of a {results['params_m']:.0f}M-parameter model ({results['model_mb']:.0f} MB "
          f"fp32), best of {repeats}:")
    for n in (1, 2):
        print(f"  {n} actor(s): {results[f'nccl_push_s_{n}']:.4f} s = {results[f'nccl_ratio_to_copy_{n}']:.1f}x "
              f"one device-to-device copy of the bytes ({results[f'nccl_copy_s_{n}'] * 1e3:.2f} ms)")
    print(f"  2 actors cost {results['nccl_two_over_one']:.2f}x one actor")
    print(f"  digest of every tensor on the device: {results['nccl_digest_s'] * 1e3:.2f} ms = "
          f"{results['nccl_digest_over_copy']:.1f}x one copy; with the bfloat16-rounded digest too: "
          f"{results['nccl_rounded_digest_s'] * 1e3:.2f} ms = {results['nccl_rounded_digest_over_copy']:.1f}x")


if __name__ == "__main__":
    main()
