"""Helpers of the placement tests: cached chains and where a block lies."""


def fill(mgr, client, lid, keys, clock=None, parent=None):
    """Commit one published block per key, chained, and drop the client's references (cached)."""
    vids = mgr.commit(client, mgr.allocate(client, lid, len(keys)), keys=keys, parent=parent)
    mgr.free(client, vids)
    return vids


def tier_of(mgr, vid):
    return mgr.place(int(vid)).tier
