"""Simulator benchmark suites (MetaWorld, PushT): tasks, seeds, step limits, success, experts.

``benchmarks.registry`` is the entry point (``get_suite``, ``list_suites``,
``catalogue``); ``benchmarks.suite`` defines what a suite and an episode are.
Imported by both ``trainer`` and ``services``; the catalogue needs no simulator.
"""
