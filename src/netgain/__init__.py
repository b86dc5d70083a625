"""netgain: compression that is a net gain on real hardware."""

__version__ = "0.1.0"
