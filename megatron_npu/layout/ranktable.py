"""HCCL rank table (RANK_TABLE_FILE, version 1.0) from the host list and each NPU's NIC address.

rank_id follows the rank map: rank = node * nproc_per_node + device_id, node = position of
the host in --hosts (torchrun's --node_rank). Every value in the file is a string.

NIC input (``--nic-file``, several allowed), any mix of:

* lines ``HOST DEVICE_ID IP`` (``#`` starts a comment);
* JSON: ``{"HOST": ["ip0", "ip1", ...]}``, ``{"HOST": {"0": "ip0", ...}}`` or
  ``[{"host": ..., "device_id": ..., "device_ip": ...}, ...]``;
* ``hccn_tool -i N -ip -g`` output concatenated per host, under a ``[HOST]`` or
  ``host HOST`` line; an echoed ``hccn_tool -i N ...`` line sets the device id, otherwise
  ``ipaddr:`` lines count up from device 0.

``--nic HOST=FILE`` reads FILE (hccn_tool output or ``DEVICE_ID IP`` lines) for one host.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import sys
from pathlib import Path

from megatron_npu.layout.rankmap import LayoutError

NicMap = dict[str, dict[int, str]]  # host -> device id -> NIC ip

_HCCN_CMD = re.compile(r"hccn_tool\s+-i\s+(\d+)\b")
_HCCN_KV = re.compile(r"^([a-z_ ]+):\s*(\S*)$", re.IGNORECASE)


class RankTableError(LayoutError):
    """Bad NIC input or a rank table that would not match the rank map."""


def _ip(value: str, where: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise RankTableError(f"{where}: {value!r} is not an IP address") from None


def _device(value: object, where: str) -> int:
    try:
        dev = int(str(value))
    except ValueError:
        raise RankTableError(f"{where}: device id {value!r} is not an integer") from None
    if dev < 0:
        raise RankTableError(f"{where}: device id {dev} is negative")
    return dev


def _put(nics: NicMap, host: str, dev: int, ip: str, where: str) -> None:
    devices = nics.setdefault(host, {})
    if dev in devices and devices[dev] != ip:
        raise RankTableError(f"{where}: device {dev} of host {host} given twice ({devices[dev]} and {ip})")
    devices[dev] = ip


def parse_nic_json(data: object, source: str, nics: NicMap | None = None) -> NicMap:
    nics = {} if nics is None else nics
    if isinstance(data, dict):
        for host, devs in data.items():
            items = enumerate(devs) if isinstance(devs, list) else devs.items() if isinstance(devs, dict) else None
            if items is None:
                raise RankTableError(f"{source}: host {host!r}: expected a list or an object of device ips")
            for dev, ip in items:
                where = f"{source}: host {host} device {dev}"
                _put(nics, str(host), _device(dev, where), _ip(str(ip), where), where)
    elif isinstance(data, list):
        for i, rec in enumerate(data):
            where = f"{source}: entry {i}"
            if not isinstance(rec, dict) or not {"host", "device_id", "device_ip"} <= rec.keys():
                raise RankTableError(f"{where}: expected {{'host', 'device_id', 'device_ip'}}")
            _put(nics, str(rec["host"]), _device(rec["device_id"], where), _ip(str(rec["device_ip"]), where), where)
    else:
        raise RankTableError(f"{source}: expected a JSON object or list")
    return nics


def parse_nic_text(text: str, source: str = "<nic>", host: str | None = None, nics: NicMap | None = None) -> NicMap:
    """Parse NIC lines; ``host`` is the host for sections without a header (``--nic HOST=FILE``)."""
    nics = {} if nics is None else nics
    stripped = text.strip()
    if stripped[:1] in "[{" and not re.match(r"^\[[^\]\s]+\]\s*$", stripped.splitlines()[0] if stripped else ""):
        try:
            return parse_nic_json(json.loads(stripped), source, nics)
        except json.JSONDecodeError as exc:
            raise RankTableError(f"{source}: line {exc.lineno}: invalid JSON ({exc.msg})") from None
    current, pending, next_dev = host, None, 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        where = f"{source}: line {lineno}"
        line = raw.split("#", 1)[0].strip() if not _HCCN_CMD.search(raw) else raw.strip()
        if not line:
            continue
        cmd = _HCCN_CMD.search(line)
        if cmd:
            pending = _device(cmd.group(1), where)
            continue
        header = re.fullmatch(r"\[(\S+)\]|host\s+(\S+)", line, re.IGNORECASE)
        if header:
            current, pending, next_dev = header.group(1) or header.group(2), None, 0
            continue
        kv = _HCCN_KV.match(line)
        if kv:
            key = kv.group(1).strip().lower()
            if key == "ipaddr":
                if current is None:
                    raise RankTableError(f"{where}: 'ipaddr:' before any [HOST] / 'host HOST' line")
                dev = pending if pending is not None else next_dev
                _put(nics, current, dev, _ip(kv.group(2), where), where)
                pending, next_dev = None, dev + 1
            elif key in ("netmask", "gateway", "ipv6addr", "prefixlen"):
                pass  # the rest of hccn_tool's -ip -g output
            else:
                raise RankTableError(
                    f"{where}: unexpected {raw.strip()!r} (want 'HOST DEVICE_ID IP' or hccn_tool output)"
                )
            continue
        parts = line.split()
        if len(parts) == 3:
            _put(nics, parts[0], _device(parts[1], where), _ip(parts[2], where), where)
        elif len(parts) == 2 and current is not None:
            _put(nics, current, _device(parts[0], where), _ip(parts[1], where), where)
        else:
            raise RankTableError(f"{where}: cannot parse {raw.strip()!r}; want 'HOST DEVICE_ID IP' or hccn_tool output")
    return nics


def build_rank_table(hosts: list[str], nics: NicMap, nproc_per_node: int) -> dict:
    """The rank table dict; device ids 0..nproc_per_node-1 on every host, rank = node*nproc + device."""
    if not hosts:
        raise RankTableError("--hosts is empty")
    if len(set(hosts)) != len(hosts):
        raise RankTableError(f"--hosts lists a host twice: {hosts}")
    unknown = sorted(set(nics) - set(hosts))
    if unknown:
        raise RankTableError(f"NIC input names hosts not in --hosts: {', '.join(unknown)}")
    servers = []
    for node, host in enumerate(hosts):
        devs = nics.get(host, {})
        missing = [d for d in range(nproc_per_node) if d not in devs]
        if missing:
            raise RankTableError(
                f"host {host}: no NIC address for device(s) {missing} (need 0..{nproc_per_node - 1}; "
                f"run `hccn_tool -i N -ip -g` on it)"
            )
        servers.append(
            {
                "server_id": host,
                "device": [
                    {"device_id": str(d), "device_ip": devs[d], "rank_id": str(node * nproc_per_node + d)}
                    for d in range(nproc_per_node)
                ],
            }
        )
    return {"status": "completed", "version": "1.0", "server_count": str(len(hosts)), "server_list": servers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-npu ranktable", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", required=True, help="comma-separated host ips in node-rank order")
    p.add_argument("--nproc-per-node", type=int, default=8, help="NPUs per node (default: 8)")
    p.add_argument(
        "--nic-file",
        action="append",
        default=[],
        help="NIC addresses, repeatable: 'HOST DEVICE_ID IP' lines; JSON {HOST: [ip, ...]}, {HOST: {id: ip}} or "
        "[{host, device_id, device_ip}]; or `hccn_tool -i N -ip -g` output per host under a [HOST] line",
    )
    p.add_argument(
        "--nic",
        action="append",
        default=[],
        metavar="HOST=FILE",
        help="one host's NIC addresses: FILE holds its `hccn_tool -i N -ip -g` output or 'DEVICE_ID IP' lines",
    )
    p.add_argument("-o", "--output", default="-", help="rank table path (default stdout)")
    a = p.parse_args(argv)
    hosts = [h.strip() for h in a.hosts.split(",") if h.strip()]
    try:
        nics: NicMap = {}
        for path in a.nic_file:
            parse_nic_text(Path(path).read_text(), path, nics=nics)
        for spec in a.nic:
            host, sep, path = spec.partition("=")
            if not sep:
                raise RankTableError(f"--nic {spec!r}: want HOST=FILE")
            parse_nic_text(Path(path).read_text(), path, host=host, nics=nics)
        if not a.nic_file and not a.nic:
            raise RankTableError("give --nic-file or --nic HOST=FILE")
        table = build_rank_table(hosts, nics, a.nproc_per_node)
    except (RankTableError, OSError) as exc:
        print(f"megatron-npu ranktable: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(table, indent=2)
    if a.output == "-":
        print(text)
    else:
        Path(a.output).write_text(text + "\n")
        print(
            f"wrote {a.output}: {len(hosts)} servers x {a.nproc_per_node} devices; set RANK_TABLE_FILE={a.output}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
