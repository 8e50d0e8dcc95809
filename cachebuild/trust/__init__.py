"""Trust: what a stored graph may say, and code named by what it is.

- ``allowed``: the closed language of stored graphs, the table of what they may call;
- ``purity``: library operators judged by their schemas, Python arithmetic bounded;
- ``fxjson``: FX graphs as plain data and back, refusing what the language does not admit;
- ``codehash`` and ``sources``: code hashed by its syntax, labelled by what it is;
- ``processes``: child interpreters that import only what they should.

May import: the values at the top of ``cachebuild``, ``cachebuild.store``.
"""
