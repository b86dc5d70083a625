"""The `netgain` command: one subcommand per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with `configure(parser)` and `run(args) -> int`, one-line help)
COMMANDS = {
    "train": ("netgain.train", "data-parallel training with a gradient codec (spawns gloo workers or runs under torchrun)"),
    "model": ("netgain.cost.advise", "predict step time per gradient codec on a network (alpha-beta model) and recommend one"),
    "profile": ("netgain.cost.profile", "time the GEMM/attention shapes of a model's layers on this device and cache the table"),
    "align": ("netgain.align.cli", "compress an LLM (low-rank or structured pruning) and re-select hardware-aligned sizes under the same parameter budget (GAC)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netgain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).configure(p)
        p.set_defaults(_module=module)
    # netgain.cost knows no codecs: `netgain model` gets their profiles from netgain.comm, as data
    sub.choices["model"].set_defaults(codec_profiles=_candidate_profiles)
    return parser


def _candidate_profiles(world_size, cost, shapes=None):
    from netgain.comm.config import candidate_profiles

    return candidate_profiles(world_size, cost, shapes)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(args._module).run(args) or 0
    except ValueError as error:  # bad input: one clear line, not a traceback
        parser.error(f"{args.command}: {error}")


if __name__ == "__main__":
    sys.exit(main())
