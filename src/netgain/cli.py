"""The `netgain` command: one subcommand per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with `configure(parser)` and `run(args) -> int`, one-line help)
COMMANDS = {
    "train": ("netgain.train", "data-parallel training with a gradient codec (spawns gloo workers or runs under torchrun)"),
    "model": ("netgain.cost.advise", "predict step time per gradient codec on a network (alpha-beta model) and what auto would run"),
    "profile": ("netgain.cost.profile", "time the GEMM/attention shapes of a model's layers on this device and cache the table"),
    "align": ("netgain.align.cli", "compress an LLM (low-rank or structured pruning) and re-select hardware-aligned sizes under the same parameter budget (GAC)"),
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, unless the help says it already or there is none to say
    (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        nothing = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if nothing or action.help is None or "default" in action.help:
            return action.help
        return action.help + " (default: %(default)s)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand, with its options only for `command`: building a subcommand's options imports its
    module (and torch), which `netgain --help` does not need."""
    parser = argparse.ArgumentParser(prog="netgain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter)
        if name == command:
            importlib.import_module(module).configure(p)
        p.set_defaults(_module=module)
    # netgain.cost knows no codecs nor align: `netgain model` gets the codecs' profiles from netgain.comm, as
    # data, and netgain.align's model types (a compressed folder counts its real layers) as a call
    sub.choices["model"].set_defaults(codec_profiles=_candidate_profiles, hsdp_profiles=_hsdp_profiles, auto_plan=_auto_plan,
                                      local_route=_local_route, model_types=_align_model_types)
    return parser


def _candidate_profiles(world_size, cost, shapes=None):
    from netgain.comm.config import candidate_profiles

    return candidate_profiles(world_size, cost, shapes)


def _hsdp_profiles(world_size, cost, shapes=None):
    """The candidates netgain.comm.fsdp runs across HSDP's replicas (its CODECS; not the planners)."""
    from netgain.comm.config import candidate_profiles
    from netgain.comm.fsdp import CODECS

    return [(profile, convergence) for profile, convergence in candidate_profiles(world_size, cost, shapes)
            if profile.name.split("(")[0] in CODECS]


def _auto_plan(numels, shapes, world_size, link, compute_s, cost):
    from netgain.comm.config import AutoConfig

    return AutoConfig().build().plan_ahead(numels, shapes, world_size, link, compute_s, cost)


def _local_route(world_size, cost):
    """auto's route of local steps (netgain.sync.ROUTE) as `netgain model` prices it."""
    from netgain.comm.calibrate import codec_profile
    from netgain.cost.advise import LocalSteps
    from netgain.sync import ROUTE, ROUTE_STEPS

    return LocalSteps(codec_profile(ROUTE.comm_config().codec.build(), world_size, cost), ROUTE.period,
                      ROUTE.overlap_steps, ROUTE_STEPS, "measured on the lab's two jobs: 1.35x and 1.02x")


def _align_model_types():
    from netgain.align.hf import register

    register()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the subcommand is the first argument that is no option: `netgain` itself takes none with a value
    parser = build_parser(next((arg for arg in argv if not arg.startswith("-")), None))
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(args._module).run(args) or 0
    except ValueError as error:  # bad input: one clear line, not a traceback
        parser.error(f"{args.command}: {error}")


if __name__ == "__main__":
    sys.exit(main())
