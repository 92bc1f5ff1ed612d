"""A server that says it keeps adapter tensors and never has them (issue 33, item 6; never a production flag).

Runs the real ``python -m swarm.server`` CLI; its adapter store files every upload (so every answer says
``prompt_held``) but finds none when a later call names it (``adapter_miss``): a liar that makes each named call
cost its client a wasted round trip and a resend, forever unless the client stops believing it.
"""
from swarm.server import adapter_tensors


def _never_found(self, digest, peer):
    self.stats.misses += 1
    return None


adapter_tensors.AdapterTensors.get = _never_found

if __name__ == "__main__":
    from swarm.server.__main__ import main

    main()
