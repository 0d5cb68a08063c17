"""The training loop and what it is built from: the step functions, building (abstract state,
shardings, jitting), the optimiser, the metric log, the lifecycle (signals, hangs, phases),
resolving a config for its devices and checking it."""
