"""Does a run that loses a rank and heals end where an uninterrupted one does? The digits task on 3 processes.

    python benchmarks/bench_fault_quality.py                 # 3 seeds x (uninterrupted, rank 0 killed): ~5 min
    python benchmarks/bench_fault_quality.py --victims rank0,middle --json benchmarks/results/fault_quality.json
    python benchmarks/bench_fault_quality.py --quick         # smoke run: 1 seed, 40 steps

Each run is ``python -m lightning_ddpx.fault.launch --nproc 3 --replacements 1`` over
``benchmarks/fault_quality_job.py``: the convergence benchmark's digits task (CNN, 6.3M parameters, SGD with
momentum) trained with the bare module's :class:`~lightning_ddpx.fault.FaultTolerance` on 3 gloo CPU
processes, global batch 48, 200 steps. Per seed, an uninterrupted run and, per victim, a run in which that
process (``rank0``, or ``middle``: the first generation's rank 1) SIGKILLs itself in the backward of step
``--kill-at`` x steps (80), gradients in flight: the survivors discard the step and retry it with the same
samples (the data order is keyed on the committed step) over two ranks until the launcher's replacement is
admitted and healed from a live peer; the run ends on 3 ranks again. Same seed: same initial weights and
data order. The column *steps x ranks* says how many steps ran on 3 and on 2 ranks.

Whether steps run on two ranks depends on how fast the replacement starts (about 10 s here): the survivors
regroup within a second of the kill (a member whose step failed closes its connections, so the other
survivor, waiting on it in the failed step's ring all-reduce, fails at once instead of after the collective
timeout) and train on two ranks until the replacement is admitted.

Reported per seed: the final validation loss of both (as the convergence benchmark takes it: the mean of the
validations at steps N - val_every and N, on the whole held-out quarter), their relative gap (goal:
|gap| <= 2 %), and whether each interrupted run's loss lies in the **95 % prediction interval** of the
uninterrupted runs over seeds (mean +- t(0.975, n-1) * sd * sqrt(1 + 1/n): where one more uninterrupted run
would land, the question asked of a single interrupted run) and in their min-max range; also the mean of the
per-seed gaps with its 95 % t interval (``benchmarks/sweep_diloco.py``'s ``paired``). A run counts only if it
really lost and healed a rank: the launcher logged the loss, a member logged ``healed ... replicas verified``,
and the 3 processes at the end hold bit-identical parameters.

Writes ``--json`` after every run (a crash keeps what finished).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment_info  # noqa: E402
from benchmarks.sweep_diloco import paired  # noqa: E402
from lightning_ddpx.bench.cleanup import exits_through_python, temporary_directory  # noqa: E402
from lightning_ddpx.bench.timing import format_table  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO_ROOT, "benchmarks", "fault_quality_job.py")
NPROC = 3
VICTIMS = {"middle": "00001", "rank0": "00000"}  # uids of the first generation's ranks 1 and 0
REPLACEMENT_UID = f"{NPROC:05d}"  # the launcher numbers the replacement after the first NPROC processes
GAP_GOAL = 0.02  # |interrupted / uninterrupted - 1| at the same seed
# 200 steps x 48 images (7 epochs of the 1347 training images): validation accuracy ~0.97 and loss ~0.09 at
# the end, as the convergence benchmark's 240 x 32 reach; about 40 s per run on 2 cores.
STEPS, VAL_EVERY = 200, 20
# A replacement needs ~10 s to start here (importing torch and Lightning on a busy machine): in a short run the
# survivors wait for it (``--degraded-pause-s``) so that it is healed before the end.
QUICK = {"steps": 40, "val_every": 10, "degraded_pause_s": 1.0}
STOP_GRACE_S = 20.0  # after SIGTERM to the launcher (it stops its children in 10 s), before SIGKILL


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"committed steps per run (default {STEPS})")
    parser.add_argument("--val-every", type=int, default=VAL_EVERY)
    parser.add_argument(
        "--kill-at", type=float, default=0.4, help="the killed step, as a fraction of --steps"
    )
    parser.add_argument("--victims", default="rank0", help=f"comma-separated, of {', '.join(VICTIMS)}")
    parser.add_argument(
        "--degraded-pause-s",
        type=float,
        default=0.0,
        help="survivors sleep this long after each step while a rank is missing: time for the replacement "
        "to arrive in a short run (it does not change what is computed)",
    )
    parser.add_argument("--json", default="runs/fault_quality.json", help="results (written after every run)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help=f"1 seed, {QUICK['steps']} steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds = 1
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
        if args.json == parser.get_default("json"):
            args.json = "runs/fault_quality_quick.json"
    args.victims = args.victims.split(",")
    unknown = [v for v in args.victims if v not in VICTIMS]
    if unknown:
        parser.error(f"unknown victim(s) {unknown}: choose from {', '.join(VICTIMS)}")
    if args.seeds < 1 or args.val_every < 1 or args.steps < 2 * args.val_every:
        parser.error("need --seeds >= 1 and --steps >= 2 x --val-every (the final loss is two validations)")
    args.kill_step = round(args.kill_at * args.steps)
    if not 0 < args.kill_step < args.steps:
        parser.error(
            f"--kill-at {args.kill_at} puts the kill at step {args.kill_step}, outside 1..{args.steps - 1}"
        )
    return args


# ------------------------------------------------------------------------------------------- one run
def run_one(args: argparse.Namespace, seed: int, victim: str | None) -> dict:
    """One launcher run; what its processes and the launcher logged, digested (see :func:`digest_run`)."""
    kill = [f"--kill={VICTIMS[victim]}:{args.kill_step}:backward"] if victim else []
    command = [
        sys.executable,
        *("-m", "lightning_ddpx.fault.launch", "--nproc", str(NPROC), "--replacements", "1", "--"),
        JOB,
        *("OUT_DIR", "--seed", str(seed), "--steps", str(args.steps), "--val-every", str(args.val_every)),
        *("--degraded-pause-s", str(args.degraded_pause_s), *kill),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        # The shared-memory transport is off, as in tests/fault/test_fault_tolerance.py: gloo's groups are the ones
        # a fault-tolerant run rebuilds.
        "DDPX_SHARED_MEMORY": "0",
        "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    with temporary_directory("ddpx-fault-quality") as out_dir:
        command[command.index("OUT_DIR")] = out_dir
        started = time.monotonic()
        with open(os.path.join(out_dir, "launcher.log"), "w+") as output:
            # In this process's group: whoever stops this benchmark stops the launcher, which stops its children.
            process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT
            )
            try:
                returncode = process.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                _stop(process)
                output.seek(0)
                raise TimeoutError(
                    f"seed {seed}, victim {victim}: the run took over {args.timeout:.0f} s (--timeout); its "
                    f"output ends with:\n{output.read()[-3000:]}"
                ) from None
            finally:  # stopped by a signal (SystemExit, KeyboardInterrupt): the launcher and its jobs go too
                if process.poll() is None:
                    _stop(process)
            output.seek(0)
            text = output.read()
        wall_s = time.monotonic() - started
        records = []
        for name in sorted(os.listdir(out_dir)):
            if name.endswith(".jsonl"):
                with open(os.path.join(out_dir, name)) as f:
                    records += [json.loads(line) for line in f if line.strip()]
    if returncode != 0:
        raise RuntimeError(
            f"seed {seed}, victim {victim}: the launcher exited with {returncode}:\n{text[-3000:]}"
        )
    run = digest_run(records, text, args.steps, args.val_every, VICTIMS.get(victim or ""))
    return {"seed": seed, "victim": victim, "wall_s": round(wall_s, 1), **run}


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the launcher (it stops its children in order), then SIGKILL: its children die with it (the
    launcher asked the kernel to kill them when it dies)."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def digest_run(records: list[dict], log: str, steps: int, val_every: int, victim_uid: str | None) -> dict:
    """The final validation loss, the curve, and the evidence that a rank was lost and healed."""
    curve = sorted({r["step"]: r for r in records if r["kind"] == "val"}.values(), key=lambda r: r["step"])
    by_step = {r["step"]: r for r in curve}
    ends = [r for r in records if r["kind"] == "end"]
    if steps not in by_step or steps - val_every not in by_step or not ends:
        raise RuntimeError(f"the run did not reach step {steps} with validations; its output:\n{log[-3000:]}")
    world_size_at = {r["step"]: r["world_size"] for r in records if r["kind"] == "step"}
    ft_lines = [line for line in log.splitlines() if "lightning_ddpx fault tolerance" in line]
    lost = victim_uid is not None and any(
        f"process {victim_uid} " in line and "lost: killed by SIGKILL" in line for line in ft_lines
    )
    healed = any(
        re.search(rf"healed {REPLACEMENT_UID} from \d+ .*replicas verified", line) for line in ft_lines
    )
    return {
        "final_val_loss": (by_step[steps - val_every]["val_loss"] + by_step[steps]["val_loss"]) / 2,
        "final_val_acc": (by_step[steps - val_every]["val_acc"] + by_step[steps]["val_acc"]) / 2,
        "last_val_loss": by_step[steps]["val_loss"],
        "curve": [[r["step"], r["val_loss"], r["val_acc"]] for r in curve],
        "ended_on": sorted(r["uid"] for r in ends),
        "replicas_equal_at_end": len({r["digest"] for r in ends}) == 1,
        "digest": ends[0]["digest"],  # of the parameters at the end (equal across processes: checked above)
        "steps_by_world_size": {
            str(w): sum(1 for v in world_size_at.values() if v == w)
            for w in sorted(set(world_size_at.values()))
        },
        "lost": lost,
        "healed": healed,
        "stats": min(ends, key=lambda r: r["uid"])["stats"],  # an original process's: it saw every change
        "fault_tolerance_log": ft_lines,
    }


def really_lost_and_healed(run: dict) -> bool:
    """The launcher saw the victim die, a member healed the replacement, and 3 equal replicas finished."""
    return (
        run["lost"]
        and run["healed"]
        and len(run["ended_on"]) == NPROC
        and REPLACEMENT_UID in run["ended_on"]
        and run["replicas_equal_at_end"]
    )


# ---------------------------------------------------------------------------------------------- stats
def summarize(runs: dict[str, dict[str, dict]], victims: list[str]) -> dict:
    """Per victim: the per-seed gaps, the goal, and where the interrupted runs lie among the uninterrupted."""
    seeds = sorted(runs, key=int)
    base = [runs[s]["uninterrupted"]["final_val_loss"] for s in seeds if "uninterrupted" in runs[s]]
    n = len(base)
    interval: dict = {
        "n": n,
        "mean": statistics.fmean(base) if base else None,
        "min": min(base, default=None),
    }
    interval["max"] = max(base, default=None)
    if n > 1:
        sd, t95 = statistics.stdev(base), paired(base, base)["t95"]
        half = t95 * sd * math.sqrt(1 + 1 / n)
        interval.update(
            sd=sd, t95=t95, prediction_low=interval["mean"] - half, prediction_high=interval["mean"] + half
        )
    out: dict = {"uninterrupted": interval, "goal_gap": GAP_GOAL, "victims": {}}
    for victim in victims:
        done = [s for s in seeds if "uninterrupted" in runs[s] and victim in runs[s]]
        killed = [runs[s][victim]["final_val_loss"] for s in done]
        gaps = [
            runs[s][victim]["final_val_loss"] / runs[s]["uninterrupted"]["final_val_loss"] - 1 for s in done
        ]
        verdict = {
            "seeds": [int(s) for s in done],
            "gaps": gaps,
            "max_abs_gap": max((abs(g) for g in gaps), default=None),
            "all_lost_and_healed": all(really_lost_and_healed(runs[s][victim]) for s in done),
            # the same parameters, bit for bit, as the uninterrupted run: the retried steps' rounding vanished
            "bit_identical_seeds": [
                int(s) for s in done if runs[s][victim]["digest"] == runs[s]["uninterrupted"]["digest"]
            ],
        }
        verdict["gap_goal_met"] = bool(gaps) and verdict["max_abs_gap"] <= GAP_GOAL
        if "prediction_low" in interval:
            inside = [interval["prediction_low"] <= k <= interval["prediction_high"] for k in killed]
            verdict["within_prediction_interval"] = all(inside)
            verdict["within_min_max"] = all(interval["min"] <= k <= interval["max"] for k in killed)
        if len(done) > 1:
            p = paired(killed, [runs[s]["uninterrupted"]["final_val_loss"] for s in done])
            se = p["diff_se"]
            verdict["paired_gap"] = {
                "mean": p["diff"],
                "se": se,
                "low": p["diff"] - p["t95"] * se,
                "high": p["diff"] + p["t95"] * se,
            }
        out["victims"][victim] = verdict
    return out


def render(saved: dict) -> str:
    runs, summary = saved["runs"], saved["summary"]
    rows = []
    for seed in sorted(runs, key=int):
        base = runs[seed].get("uninterrupted")
        for victim in saved["victims"]:
            run = runs[seed].get(victim)
            if base is None or run is None:
                continue
            gap = run["final_val_loss"] / base["final_val_loss"] - 1
            rows.append(
                [
                    seed,
                    victim,
                    f"{base['final_val_loss']:.4f}",
                    f"{run['final_val_loss']:.4f}",
                    f"{100 * gap:+.4f} %",
                    f"{base['final_val_acc']:.4f} / {run['final_val_acc']:.4f}",
                    "/".join(f"{k}x{v}" for k, v in sorted(run["steps_by_world_size"].items(), reverse=True)),
                    "yes" if really_lost_and_healed(run) else "NO",
                    "yes" if run["digest"] == base["digest"] else "no",
                    f"{base['wall_s']:.0f} / {run['wall_s']:.0f}",
                ]
            )
    header = [
        "seed",
        "killed",
        "val_loss uninterrupted",
        "interrupted",
        "gap",
        "val_acc (both)",
        "steps x ranks",
        "lost+healed",
        "same bits",
        "wall s (both)",
    ]
    lines = [
        f"digits, {NPROC} gloo processes, {saved['steps']} steps (global batch {saved['global_batch']}), "
        f"killed mid-backward at step {saved['kill_step']}; final val_loss = mean of the validations at steps "
        f"{saved['steps'] - saved['val_every']} and {saved['steps']}",
        format_table(header, rows),
    ]
    interval = summary["uninterrupted"]
    if "prediction_low" in interval:
        lines.append(
            f"uninterrupted over {interval['n']} seeds: mean {interval['mean']:.4f}, sd {interval['sd']:.4f}; 95 % "
            f"prediction interval (t, {interval['n'] - 1} dof) {interval['prediction_low']:.4f} .. "
            f"{interval['prediction_high']:.4f}; min-max {interval['min']:.4f} .. {interval['max']:.4f}"
        )
    for victim, verdict in summary["victims"].items():
        if verdict["max_abs_gap"] is None:
            continue
        text = (
            f"{victim}: max |gap| {100 * verdict['max_abs_gap']:.3f} % "
            f"(goal <= {100 * GAP_GOAL:.0f} %: {'met' if verdict['gap_goal_met'] else 'NOT met'})"
        )
        if "within_prediction_interval" in verdict:
            text += (
                f"; in the 95 % prediction interval: {'yes' if verdict['within_prediction_interval'] else 'NO'}, "
                f"in min-max: {'yes' if verdict['within_min_max'] else 'NO'}"
            )
        if "paired_gap" in verdict:
            p = verdict["paired_gap"]
            text += (
                f"; mean gap {100 * p['mean']:+.3f} % ± {100 * p['se']:.3f} "
                f"(95 % t interval {100 * p['low']:+.3f} .. {100 * p['high']:+.3f} %)"
            )
        if not verdict["all_lost_and_healed"]:
            text += "; WARNING: not every interrupted run lost and healed a rank"
        lines.append(text)
    return "\n".join(lines)


@exits_through_python()  # SIGTERM/SIGHUP unwind like Ctrl-C: the launcher is stopped, the directory deleted
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    saved: dict = {
        "task": "digits",
        "nproc": NPROC,
        "steps": args.steps,
        "val_every": args.val_every,
        "global_batch": 48,
        "kill_step": args.kill_step,
        "kill_point": "backward",
        "victims": args.victims,
        "degraded_pause_s": args.degraded_pause_s,
        "command": " ".join(
            ["python", "benchmarks/bench_fault_quality.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "environment": environment_info(),  # machine, load and date, which the docs' figures cite
        "runs": {},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    started = time.monotonic()
    for seed in range(args.seeds):
        for victim in [None, *args.victims]:
            run = run_one(args, seed, victim)
            saved["runs"].setdefault(str(seed), {})[victim or "uninterrupted"] = run
            print(
                f"seed {seed} {victim or 'uninterrupted'}: val_loss {run['final_val_loss']:.4f} "
                f"({run['wall_s']:.0f} s)",
                flush=True,
            )
            saved["summary"] = summarize(saved["runs"], args.victims)
            saved["wall_s"] = round(time.monotonic() - started, 1)
            with open(args.json + ".tmp", "w") as f:
                json.dump(saved, f, indent=1)
            os.replace(args.json + ".tmp", args.json)
    print(render(saved), flush=True)
    return saved


if __name__ == "__main__":
    main()
