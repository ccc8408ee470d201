"""Editing a JSON state, for the tests that try every edit of one: the paths of its fields, and a copy with one field
replaced or deleted."""
import json

DELETE = object()   # the edit that deletes a field


def paths(x, path=()) -> list:
    "The path of every value of a JSON state: the state itself (`()`) first, then its fields and list items, depth first."
    out = [path]
    if isinstance(x, dict): out += [q for k, v in x.items() for q in paths(v, path + (k,))]
    elif isinstance(x, list): out += [q for i, v in enumerate(x) for q in paths(v, path + (i,))]
    return out


def edited(state, path, value):
    "A copy of `state` with the field at `path` set to `value` (or deleted, for `DELETE`); None where that leaves the state as it was (the same JSON), would delete a list item, or `path` is not in `state` (another rank's state, whose lists differ in length)."
    bad = json.loads(json.dumps(state))
    parent = bad
    for k in path[:-1]:
        if isinstance(parent, list) and not (isinstance(k, int) and k < len(parent)) or isinstance(parent, dict) and k not in parent: return None
        parent = parent[k]
    if isinstance(parent, list) and path[-1] >= len(parent): return None
    if value is not DELETE: parent[path[-1]] = value
    elif isinstance(parent, dict): del parent[path[-1]]
    else: return None
    return None if json.dumps(bad) == json.dumps(state) else bad
