"""Graph facts: what is known about a graph, the tensors it reads and what it returns.

- ``facts``: a graph's inputs and values, shared by every layer above;
- ``effects``: what a graph writes in place and which of its values share memory;
- ``inputs``: what compiled code assumes about its tensors, checked before it reads them;
- ``outputs``: the model's own output structure around the graph's tensors;
- ``weights``: a model's weights replaced by other tensor objects, noticed;
- ``graphdiff``: what changed between two piece graphs, in words.

May import: the values at the top of ``cachebuild``, ``store``, ``passes``, ``trust``.
"""
