"""Tracing: a model traced once, what the trace read, and its pieces as keyed targets.

- ``trace``: Dynamo run once into a ``TracedGraph``; ``transforms`` turns functorch
  transforms into the operators they run;
- ``split``: the graph cut at splitting ops into pieces;
- ``targets``: each compiled piece × shape bucket, with its key and manifest; ``env`` and
  ``distributed``: the environment and process-group factors of every key;
- ``guards``: what the trace read besides tensors, checked with plain Python;
  ``guard_export`` turns Dynamo's guards into those records, ``guard_watch`` holds them on
  every call.

May import: everything in ``graph`` and below (the values, ``store``, ``passes``, ``trust``).
"""
