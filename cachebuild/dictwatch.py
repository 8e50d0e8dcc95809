"""Noticing that dicts changed without reading them: what keeps a guard check O(1).

Most of what a trace reads lives in dicts: a module's ``__dict__`` (a flag, an adapter's
name, ``training``), its ``_modules`` and ``_parameters``, its hook dicts, a module's
globals, the environment. CPython says when a dict changes in two ways:

- From 3.12, *dict watchers* (``PyDict_AddWatcher``): CPython calls a function on every
  change of a dict marked as watched, with the key. ``DictWatcher`` moves the counter of
  each watch that asked for that key of that dict; a check reads its own counter: one
  integer comparison, however many dicts.
- On 3.11, every dict carries a version tag (``ma_version_tag``, PEP 509) that changes
  whenever the dict does. ``TagPoll`` reads the tags of the watched dicts and compares:
  one read per dict, no key filter.

``watch(pairs)`` returns a function that is True while none of the watched dicts changed
at a watched key (``ANY``: at any key) since it was made. Which of the two is used is
``compat.dict_watch_kind``'s choice.

Neither sees an object given another dict (``obj.__dict__ = {...}``): the old dict is not
changed, only no longer the object's. ``kept_dicts`` notices that by reading where each
object keeps the pointer to its dict, in one gather as ``TagPoll`` reads tags.
"""

from __future__ import annotations

import atexit
import ctypes
import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

#: A key that stands for every key of a dict (its length, its keys, any entry).
ANY = object()

# PyDictObject: ob_refcnt, ob_type, ma_used, then ma_version_tag (CPython, 64-bit).
_TAG_OFFSET = 3 * ctypes.sizeof(ctypes.c_void_p)
_DEALLOCATED = 5  # PyDict_EVENT_DEALLOCATED in CPython 3.12's enum


_WORD = ctypes.sizeof(ctypes.c_void_p)
_MANAGED_DICT = 1 << 4  # Py_TPFLAGS_MANAGED_DICT (3.11 on): the pointer 3 words before


def _unchanged_words(places: list[int], kept: list[Any]) -> Callable[[], bool]:
    """True while the machine words at ``places`` hold what they hold now. They are read
    in one gather: a NumPy view of the address range that holds them all, indexed at
    their places (a read of each word, nothing else), so a thousand cost microseconds.
    ``kept``: the objects the words belong to, kept alive so that none is read from freed
    memory."""
    import numpy as np

    if not places:
        return lambda: True
    base = min(places)
    span = max(places) - base + _WORD
    memory = np.ctypeslib.as_array(
        ctypes.cast(base, ctypes.POINTER(ctypes.c_uint64)), shape=(span // _WORD,))
    index = np.array([(p - base) // _WORD for p in places], dtype=np.intp)
    words = memory.take(index).tobytes()

    def unchanged(memory: Any = memory, index: Any = index, words: bytes = words,
                  kept: list[Any] = kept) -> bool:
        return memory.take(index).tobytes() == words

    return unchanged


class TagPoll:
    """Watches by polling version tags (CPython 3.11 to 3.13), all in one gather."""

    def watch(self, pairs: Iterable[tuple[dict[Any, Any], Any]]) -> Callable[[], bool]:
        kept = list({id(d): d for d, _ in pairs}.values())
        return _unchanged_words([id(d) + _TAG_OFFSET for d in kept], kept)


def dict_slot(obj: Any, own: dict[Any, Any]) -> int | None:
    """The address where ``obj`` keeps the pointer to its ``__dict__`` (``own`` now); None
    where that is not known to be so (a layout this Python does not have)."""
    kind = type(obj)
    if kind.__flags__ & _MANAGED_DICT:
        place = id(obj) - 3 * _WORD
    elif kind.__dictoffset__ > 0:
        place = id(obj) + kind.__dictoffset__
    else:
        return None
    return place if ctypes.c_void_p.from_address(place).value == id(own) else None


def kept_dicts(owners: Iterable[tuple[Any, dict[Any, Any]]]) -> Callable[[], bool]:
    """True while each object of ``owners`` still has the dict it has now (none was given
    another, ``obj.__dict__ = {...}``): its dict pointer read where ``dict_slot`` finds
    it, else ``vars(obj)`` compared at each call."""
    places, kept, others = [], [], []
    for obj, own in owners:
        place = dict_slot(obj, own)
        if place is None:
            others.append((obj, own))
        else:
            places.append(place)
            kept.append(obj)
    pointers = _unchanged_words(places, kept)
    if not others:
        return pointers
    objects, dicts = [o for o, _ in others], [d for _, d in others]
    return lambda: pointers() and all(map(operator.is_, map(vars, objects), dicts))


class _Changes:
    """How many times the dicts of one ``watch`` changed at a watched key."""

    __slots__ = ("count", "__weakref__")

    def __init__(self) -> None:
        self.count = 0


class DictWatcher:
    """One CPython dict watcher for the process (3.12 and later). Each ``watch`` gets its
    own counter, moved on every change of one of its dicts at one of its keys: a change
    (or a freed dict) elsewhere costs other watches nothing."""

    def __init__(self) -> None:
        api = ctypes.pythonapi
        callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_void_p)
        self._callback = callback_type(self._changed)  # kept alive for the process
        api.PyDict_AddWatcher.argtypes = [callback_type]
        api.PyDict_AddWatcher.restype = ctypes.c_int
        api.PyDict_Watch.argtypes = [ctypes.c_int, ctypes.py_object]
        api.PyDict_Watch.restype = ctypes.c_int
        api.PyDict_ClearWatcher.argtypes = [ctypes.c_int]
        api.PyDict_ClearWatcher.restype = ctypes.c_int
        self._id = api.PyDict_AddWatcher(self._callback)
        if self._id < 0:
            api.PyErr_Clear()
            raise OSError("no dict watcher is free in this interpreter")
        self._api = api
        #: id of a watched dict → (a watch's counter, the keys it watches there; ANY in
        #: them: every key), a weak reference so that a watch dropped is forgotten
        # A list here is never changed in place but by an append: the callback reads them
        # without the lock (it runs inside any thread's dict change), so a pruned list is
        # a new one, and a freed dict's id is left for ``watch`` to drop under the lock.
        self._watches: dict[int, list[tuple[weakref.ref[_Changes], set[Any]]]] = {}
        self._freed: list[int] = []
        self._since_pruned = 0
        self._lock = threading.Lock()
        self._closed = False
        # CPython would call the watcher as the interpreter ends, when module dicts are
        # cleared and freed, after the callback's memory is gone: a crash at exit.
        atexit.register(self.close)
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork

    def close(self) -> None:
        """Takes the watcher out of CPython. Every check armed before then reads as
        changed from now on; later watches poll version tags (``TagPoll``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._api.PyDict_ClearWatcher(self._id) < 0:
                self._api.PyErr_Clear()
            for entries in list(self._watches.values()):
                _count(entries, None)
            self._watches = {}

    def _changed(self, event: int, d: int, key: int | None, value: int | None) -> int:
        # Runs inside the dict's change: reads only our own tables, moves counters.
        entries = self._watches.get(d)
        if not entries:
            return 0
        if event == _DEALLOCATED:
            self._freed.append(d)  # its id may be reused by another dict: dropped later
            _count(entries, None)
        elif key is None:
            _count(entries, None)
        else:
            try:
                _count(entries, ctypes.cast(key, ctypes.py_object).value)
            except Exception:  # a key whose comparison raised: count it as a change
                _count(entries, None)
        return 0

    def watch(self, pairs: Iterable[tuple[dict[Any, Any], Any]]) -> Callable[[], bool]:
        changes = _Changes()
        with self._lock:
            if self._closed:
                return TagPoll().watch(pairs)
            while self._freed:  # freed since: their ids may be new dicts' now
                self._watches.pop(self._freed.pop(), None)
            wanted: dict[int, tuple[dict[Any, Any], set[Any]]] = {}
            for d, key in pairs:
                wanted.setdefault(id(d), (d, set()))[1].add(key)
            for place, (d, keys) in wanted.items():
                entries = self._watches.get(place)
                if entries is None:
                    if self._api.PyDict_Watch(self._id, d) < 0:
                        self._api.PyErr_Clear()
                        raise OSError("a dict could not be watched")
                    entries = self._watches[place] = []
                entries.append((weakref.ref(changes), keys))
            self._since_pruned += 1
            if self._since_pruned > 64:  # forget the watches nobody checks any more
                self._since_pruned = 0
                for place, entries in list(self._watches.items()):
                    self._watches[place] = [e for e in entries if e[0]() is not None]
        return lambda changes=changes: changes.count == 0


def _count(entries: list[tuple[weakref.ref[_Changes], set[Any]]], key: Any) -> None:
    """Moves the counter of every live watch in ``entries`` that watches ``key`` (None:
    every one, a change with no key or the dict freed). A key whose comparison raises
    raises here: the caller counts that as a change of every watch."""
    for ref, keys in entries:
        changes = ref()
        if changes is not None and (key is None or ANY in keys or key in keys):
            changes.count += 1


_WATCHER: list[Any] = []
_LOCK = threading.Lock()


def watcher(use_watchers: bool) -> TagPoll | DictWatcher:
    """The process's watcher: CPython's dict watchers where ``use_watchers`` and one is
    free, else polling."""
    with _LOCK:
        if not _WATCHER:
            found: TagPoll | DictWatcher = TagPoll()
            if use_watchers:
                try:
                    found = DictWatcher()
                except (OSError, AttributeError):  # all taken, or no such API
                    pass
            _WATCHER.append(found)
        return _WATCHER[0]
