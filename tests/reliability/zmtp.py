"""A raw ZMTP peer over a unix socket (no libzmq), to see what the daemon does at the greeting.

    python3 tests/reliability/zmtp.py SOCKET_PATH zmtp3|legacy|silent

Prints one word: `ready` (the daemon accepted a ZMTP/3 NULL handshake), `error:<reason>` (it sent
an ERROR command, e.g. a ZAP refusal), or `closed` (it closed the connection). Runs under any
Python 3, so a test can start it as another user.
"""

import socket
import struct
import sys
import time


def greeting() -> bytes:
    # signature, version 3.0, mechanism NULL, as-server 0, filler
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def ready_command() -> bytes:
    name, value = b"Socket-Type", b"DEALER"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return b"\x04" + bytes([len(body)]) + body


def read_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    data = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            chunk = s.recv(4096)
        except socket.timeout:
            break
        if not chunk:
            return data + b"<EOF>"
        data += chunk
        if b"READY" in data[64:] or b"ERROR" in data[64:]:
            break
    return data


def main() -> int:
    path, mode = sys.argv[1], sys.argv[2]
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    if mode == "zmtp3":
        s.sendall(greeting() + ready_command())
    elif mode == "legacy":  # ZMTP/1.0: an identity frame (length, flags) with no 0xFF signature
        s.sendall(b"\x01\x00" + b"\x05\x00hello")
    data = read_all(s, timeout)
    if b"ERROR" in data[64:]:
        i = data.index(b"ERROR", 64) + 5
        print("error:" + data[i + 1:i + 1 + data[i]].decode(errors="replace"))
    elif b"READY" in data[64:]:
        print("ready")
    elif data.endswith(b"<EOF>"):
        print("closed")
    else:
        print("open")
    return 0


if __name__ == "__main__":
    sys.exit(main())
