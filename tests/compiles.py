"""Helpers for tests of netgain.comm.kernel's background compiles, in the test's process (monkeypatch's setters)
or in a spawned rank (plain ones)."""

from netgain.comm import kernel


def compile_every_call(set_attr, set_env) -> None:
    """NETGAIN_COMPILE=auto, a compiler taken as present, and every kernel call worth a compile (no heat needed)."""
    set_env("NETGAIN_COMPILE", "auto")
    set_attr(kernel, "_compiler_present", lambda device_type: True)
    set_attr(kernel, "HOT_CALLS", 1)
    set_attr(kernel, "COMPILE_SHARE", 0.0)


def record_compiles(set_attr) -> list:
    """The compile thread's queue taken: each compile begun is appended as (variant, args, kwargs, threads), none runs."""
    jobs = []
    set_attr(kernel, "_compiles", type("Queue", (), {"put": lambda self, job: jobs.append(job)})())
    set_attr(kernel, "_compile_thread", "running")
    return jobs
