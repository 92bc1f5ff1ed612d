"""The DHT process reads each command whole, however its parts arrive (swarm.dht.node.WholeMessageReader).

A shuffled, loaded run hung: a test's DHT process had died reading a 16 KB command half-written, and the test waited
for its answer forever. These tests write a message's length and, later, its body, as the sending process does when
it is descheduled between the two writes of a message over 16 KB.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
import threading
from functools import partial

import pytest

from swarm.dht.node import WholeMessageReader

MESSAGE = ("_run_coroutine", [], {"payload": b"x" * 20_000})  # over the 16 KB that multiprocessing writes in two parts


def half_written(delay: float = 0.2):
    """A pipe as the DHT process sees it (its read end non-blocking), with a message's length already in it and the
    body following after ``delay`` seconds."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    os.set_blocking(reader.fileno(), False)
    body = pickle.dumps(MESSAGE)
    os.write(writer.fileno(), struct.pack("!i", len(body)))
    later = threading.Timer(delay, lambda: os.write(writer.fileno(), body))
    later.start()
    return reader, writer, later


@pytest.mark.unit
def test_a_plain_read_of_a_half_written_message_fails_as_it_did():
    reader, writer, later = half_written()
    try:
        assert reader.poll(1)  # readable: the length is there, which is what wakes the process
        with pytest.raises(BlockingIOError):
            reader.recv()
    finally:
        later.join()
        reader.close()
        writer.close()


@pytest.mark.unit
def test_the_process_reads_the_message_whole_and_leaves_the_pipe_non_blocking():
    reader, writer, later = half_written()
    whole = WholeMessageReader(reader)
    try:
        assert whole.poll(1) and whole.fileno() == reader.fileno()  # the rest of the connection, unchanged
        assert whole.recv() == MESSAGE
        assert not os.get_blocking(reader.fileno()), "the loop's own setting is restored"
    finally:
        later.join()
        reader.close()
        writer.close()


async def _size(dht, node, payload: bytes) -> int:
    return len(payload)


@pytest.mark.swarm
def test_a_dht_process_runs_a_command_of_a_megabyte():
    """The reader in place in a real DHT process: a command far over 16 KB (a megabyte of arguments) is answered."""
    from swarm.dht.node import NetworkConfig, start_dht, stop_dht

    dht = start_dht(NetworkConfig(use_default_peers=False))  # a peer of its own on 127.0.0.1
    try:
        assert dht.run_coroutine(partial(_size, payload=b"y" * 2**20), return_future=True).result(60) == 2**20
        assert dht.run_coroutine(partial(_size, payload=b"z"), return_future=True).result(60) == 1  # and the next
    finally:
        stop_dht(dht)
