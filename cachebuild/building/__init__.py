"""Building: a model's entry planned, its targets built or loaded, and proven.

- ``entry``: what a warm process needs instead of Dynamo; ``entry_key``: its key, from
  the live model and call; ``planner``: trace → split → targets → entry;
- ``build``: the Builder, the only way an artifact is produced or loaded; ``verify``:
  each artifact proven against its own piece; ``pool``: builds in worker processes;
  ``background``: targets built in workers and loaded while the caller goes on;
- ``notice``: a start that must build says so first; ``nearest``: why a target or entry
  is missing, by the nearest stored one and what differs; ``settings``: the building
  variables of the environment, checked when a run starts.

May import: ``tracing``, ``backends`` and everything below them.
"""
