"""What receipts cost (issue 55): per answer on a server and a client, and per audited call.

    python benchmarks/receipts.py [--rows 192] [--hidden 4096] [--repeats 200]

Per answer: the server's digests (the request as it travelled, the answer as encoded) and one RSA-2048 signature;
the client's same digests and one verification; the receipt's bytes in the answer's metadata. Per audited call: the
evidence's bytes (a call of ROWS x HIDDEN in bfloat16, both ways) and parsing it. Timings are the best of REPEATS,
interleaved, on this machine; the recomputation itself is one pass of the call's blocks (the auditor's, not
measured here).
"""
from __future__ import annotations

import argparse
import json
import time

import msgpack
import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarm.client.receipts import as_evidence
from swarm.wire.encoding import encode_tensor
from swarm.wire.evidence import CallEvidence
from swarm.wire.messages import ForwardRequest
from swarm.wire.receipts import CallContent, ReceiptSigner, tensor_digest
from swarm.wire.remote import SignedCall


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    hidden = torch.randn(1, args.rows, args.hidden).to(torch.bfloat16)
    request = ForwardRequest(0, 4, hidden, "session", 7)
    sent, answer = encode_tensor(hidden), encode_tensor(hidden + 1)
    signer = ReceiptSigner(RSAPrivateKey(), "bench-model", exact=True, invariant=True)

    def digests() -> tuple[bytes, bytes]:
        content = CallContent(0, 4, "session", 7, None, None, None, None, tensor_digest(sent))
        return content.digest(), tensor_digest(answer)

    request_digest, answer_digest = digests()
    receipt = signer.sign(request_digest, answer_digest)
    evidence = as_evidence(SignedCall("", request, receipt, sent, answer))
    data = evidence.to_bytes()
    figures = {
        "call": f"{args.rows} rows x {args.hidden} bfloat16 ({len(sent.buffer)} bytes each way)",
        "digests_ms": 1000 * best(digests, args.repeats),
        "sign_ms": 1000 * best(lambda: signer.sign(request_digest, answer_digest), args.repeats),
        "verify_ms": 1000 * best(receipt.valid_signature, args.repeats),
        "receipt_bytes": len(msgpack.packb(receipt.to_wire(), use_bin_type=True)),
        "evidence_bytes": len(data),
        "parse_evidence_ms": 1000 * best(lambda: CallEvidence.from_bytes(data), max(1, args.repeats // 10)),
        "check_evidence_signature_ms": 1000 * best(lambda: evidence.problem("bench-model"),
                                                   max(1, args.repeats // 10)),
    }
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
