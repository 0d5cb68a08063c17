"""Compiling without data or devices: the dry run, named TPU/GPU targets, reading and costing
optimised HLO, the roofline and the choice of a mesh."""
