"""Serving: what a compiled model runs at each call.

- ``start``: a model's start in one pass (found and guards hold → load; else trace and
  build); ``interim``: serving while the targets build;
- ``stitch``: compiled pieces dispatched by size, splitting ops run eagerly; ``runtime``:
  the stitched forward bound to a live model; ``hooks``: what a call would skip (hooks on
  the model, global module hooks, a forward set on the instance), refused;
- ``capture``, ``cudagraphs`` and ``graphmodes``: which sizes are captured into device
  graphs, how, and which kind of graph serves a call.

May import: ``building`` and everything below it; never the front doors or the CLI.
"""
