"""How the prefix planner's time grows with the batch: prompts x average length -> seconds, tokens/s.

Inputs are Python lists of token ids (what a JSONL batch gives), so the time includes turning them into one
numpy array. Each row is the best of --repeat runs of `plan_prefixes(prompts)` (BatchLLM's Algorithm 1).
The industrial-like 8000 x ~1600 row is the size BatchLLM reports 1.51 s for; the goal here is <= 1.5 s.

    python -m bench.plan_scaling [--repeat 3] [--quick]
"""

import argparse
import gc

from bench.harness import machine
from bench.harness.workloads import industrial, microbench, multilevel, no_sharing
from flock.prefix import plan_prefixes


def cases(quick: bool):
    # (name, generator) -- industrial-like shape at growing prompt counts and lengths: linear in total tokens?
    for n in ((1000, 8000) if quick else (1000, 2000, 4000, 8000)):
        yield f"industrial n={n}", lambda n=n: industrial(num_prompts=n)
    for scale in ((0.25,) if quick else (0.25, 0.5, 2.0)):
        yield f"industrial n=8000 x{scale}", lambda s=scale: industrial(num_prompts=8000, scale=s)
    if not quick:
        yield "industrial n=16000", lambda: industrial(num_prompts=16000)
    yield "micro 2000/200 sd16 x32 groups", lambda: microbench(2000, 200, 16, num_groups=32)
    yield "micro 2000/1000 sd4 x128 groups", lambda: microbench(2000, 1000, 4, num_groups=128)
    yield "multilevel 4x8x8", lambda: multilevel()
    yield "multilevel 8x32x32 (8192)", lambda: multilevel(num_systems=8, docs_per_system=32, questions_per_doc=32)
    yield "no sharing 8000 x 1600", lambda: no_sharing(num_prompts=8000, prompt_len=1600)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer rows")
    ap.add_argument("--optimal", action="store_true", help="also time the exact first-level DP")
    args = ap.parse_args()
    print(machine.header("plan_scaling", kernels=False))

    head = (f"{'workload':<32} {'prompts':>7} {'avg len':>7} {'Mtokens':>8} {'plan s':>7} {'Mtok/s':>7} "
            f"{'(list->np':>9} {'tree':>6} {'lvl1)':>6} {'groups':>6} {'deg':>5} {'saving':>7} {'bound':>7}"
            + (f" {'opt s':>6} {'opt sav':>7}" if args.optimal else ""))
    print(head)
    print("-" * len(head))
    for name, make in cases(args.quick):
        prompts = make()
        tokens = sum(map(len, prompts))
        best = None
        for _ in range(args.repeat):
            gc.collect()
            plan = plan_prefixes(prompts)
            if best is None or plan.plan_seconds < best.plan_seconds:
                best = plan
        t = best.timings
        row = (f"{name:<32} {len(prompts):>7} {tokens / len(prompts):>7.0f} {tokens / 1e6:>8.2f} {best.plan_seconds:>7.3f} "
               f"{tokens / best.plan_seconds / 1e6:>7.1f} {t['tokens']:>9.3f} {t['tree']:>6.3f} {t['first_level']:>6.3f} "
               f"{best.num_groups:>6} {best.mean_sharing_degree():>5.2f} {best.saving_rate:>7.1%} {best.saving_rate_bound:>7.1%}")
        if args.optimal:
            opt = plan_prefixes(prompts, "optimal")
            row += f" {opt.plan_seconds:>6.3f} {opt.saving_rate:>7.1%}"
        print(row, flush=True)
        del prompts, plan, best
    print("\nplan s: best of", args.repeat, "runs, Python lists in; list->np / tree / lvl1: its parts (the rest: groups).")
    print("The paper reports 1.51 s for 8000 industrial prompts.")


if __name__ == "__main__":
    main()
