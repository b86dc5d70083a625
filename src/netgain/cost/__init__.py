"""Cost models: network collectives, GPU kernel latency (analytic), and kernel timings measured on this device."""
