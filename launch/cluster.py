"""python -m launch.cluster RECIPE [key.sub=value ...] [--print-config] [--dry-run] [--preflight [--simulate]]"""
from __future__ import annotations

import argparse
import sys

import msgspec

from config import ConfigError, apply_overrides
from config.recipes import RECIPES, get_recipe


def parse_args(argv: list[str]) -> argparse.Namespace:
    recipes = "\n".join(f"  {name:<12} {(fn.__doc__ or '').strip().splitlines()[0]}" for name, fn in RECIPES.items())
    p = argparse.ArgumentParser(
        prog="python -m launch.cluster", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start an arctic-rl run: a recipe plus typed overrides.",
        epilog=f"recipes:\n{recipes}\n\nexample:\n  python -m launch.cluster bird_32b model.path=/models/qwen3-32b "
               "data.bird_dir=/data/bird learner.lr=2e-6",
    )
    p.add_argument("recipe", help="one of: " + ", ".join(RECIPES))
    p.add_argument("overrides", nargs="*", help="section.key=value, converted to the field's type")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument("--dry-run", action="store_true", help="print the placement and memory plan and exit")
    p.add_argument("--preflight", action="store_true",
                   help="place every actor as planned (light probes, no model), check the learner all-reduce, "
                        "one weight-sync bucket and Redis from every node; print a table and exit")
    p.add_argument("--simulate", action="store_true",
                   help="with --preflight: on a local Ray cluster of the recipe's shape (logical GPUs)")
    # intermixed: flags may come after the recipe or between overrides (`gpu1_0p6b --dry-run learner.lr=1e-5`)
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    from observe.logs import quiet_cpu_host

    quiet_cpu_host()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = apply_overrides(get_recipe(args.recipe), args.overrides)
        if args.print_config:
            print(msgspec.json.format(msgspec.json.encode(cfg).decode(), indent=2))
            return 0
        if args.dry_run:
            from launch.plan import make_plan

            plan = make_plan(cfg)
            print(plan.render())
            return 0 if plan.fits else 1
        if args.simulate and not args.preflight:
            raise ConfigError("--simulate goes with --preflight")
        if args.preflight:
            from launch.preflight import PreflightFailed, preflight

            try:
                print(preflight(cfg, simulate=args.simulate).render(), flush=True)
            except PreflightFailed as e:
                print(f"error: preflight: {e}", file=sys.stderr)
                return 1
            except Exception as e:  # noqa: BLE001 - anything else is one line too (Ray, sockets)
                from launch.run import one_line

                print(f"error: preflight: {one_line(e)}", file=sys.stderr)
                return 1
            return 0
        from launch.run import run

        return run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def exit_now(code: int) -> None:
    """The process's exit once main() returned: the run's actors, Ray and Redis are stopped and its files
    written (logs are line-buffered), so Python's own teardown of the ~1,000 modules Ray and the launcher
    import (0.25-0.5 s on 2 cores, measured: an import of launch.run and ray, then exit) is skipped."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
