#!/usr/bin/env python3
"""Memory and latency of rlsd while Redis is stopped under a flood (issue 42, item 3).

Starts a private redis-server (or a 3-master Redis Cluster) on free loopback ports and rlsd
(a release build) on it, then floods rlsd with h2load (one 3-descriptor body, far more streams
than a stopped Redis can serve): a few seconds with Redis running, then SIGSTOP for
`--stop-seconds`, then SIGCONT and a few seconds more. rlsd's RSS (/proc/PID/status VmRSS) is
sampled every 100 ms throughout; h2load's per-request log gives latency per phase; /metrics
gives the late-call gauges. Prints one table; asserts nothing.

    python3 benches/late_calls_flood.py --rlsd target/release/rlsd [--mode redis|cluster]
        [--connections 64] [--streams 64] [--stop-seconds 10] [-- extra rlsd flags]
"""
import argparse, os, signal, socket, subprocess, sys, tempfile, threading, time, urllib.request

CONFIG = """domain: flood
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 4000000000}
  - key: plan
    value: pro
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 4000000000}
  - key: endpoint
    value: search
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 4000000000}
"""


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number, payload):
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def descriptor(entries):
    return b"".join(field(1, field(1, k.encode()) + field(2, v.encode())) for k, v in entries)


def grpc_body():
    message = field(1, b"flood") + b"".join(field(2, descriptor(d)) for d in [
        [("remote_address", "10.0.0.1")],
        [("plan", "pro"), ("api_key", "key-1")],
        [("endpoint", "search"), ("api_key", "key-1")],
    ])
    return b"\0" + len(message).to_bytes(4, "big") + message


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Cluster bus ports are port + 10000.
    return port if port < 55000 else free_port()


def wait_port(port, timeout=10):
    until = time.time() + timeout
    while time.time() < until:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"port {port} never opened")


def redis_node(directory, port, cluster):
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", directory]
    if cluster:
        args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    wait_port(port)
    return child


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def percentile(sorted_values, p):
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(p * len(sorted_values)))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rlsd", required=True)
    parser.add_argument("--mode", choices=["redis", "cluster"], default="redis")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--before-seconds", type=float, default=3)
    parser.add_argument("--stop-seconds", type=float, default=10)
    parser.add_argument("--after-seconds", type=float, default=4)
    parser.add_argument("--grpc-timeout", help="the callers' grpc-timeout header (e.g. 20m, 1S); none by default")
    parser.add_argument("extra", nargs="*")
    options = parser.parse_args()
    work = tempfile.mkdtemp(prefix="rlsd-flood-")
    children = []
    try:
        if options.mode == "redis":
            ports = [free_port()]
            children.append(redis_node(work, ports[0], False))
            masters = children[:]
            url = f"redis://127.0.0.1:{ports[0]}"
        else:
            ports = [free_port() for _ in range(3)]
            children += [redis_node(work, port, True) for port in ports]
            subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                            "--cluster-replicas", "0", "--cluster-yes"], check=True,
                           stdout=subprocess.DEVNULL)
            until = time.time() + 20
            while b"cluster_state:ok" not in subprocess.run(
                    ["redis-cli", "-p", str(ports[0]), "cluster", "info"],
                    capture_output=True).stdout:
                if time.time() > until:
                    sys.exit("cluster never became ok")
                time.sleep(0.1)
            masters = children[:]
            url = ",".join(f"redis://127.0.0.1:{p}" for p in ports)
        config = os.path.join(work, "config")
        os.mkdir(config)
        with open(os.path.join(config, "flood.yaml"), "w") as f:
            f.write(CONFIG)
        body = os.path.join(work, "body")
        with open(body, "wb") as f:
            f.write(grpc_body())
        grpc, http, metrics = free_port(), free_port(), free_port()
        args = [options.rlsd, "serve", "--config", config, "--redis-url", url,
                "--grpc-addr", f"127.0.0.1:{grpc}", "--http-addr", f"127.0.0.1:{http}",
                "--metrics-addr", f"127.0.0.1:{metrics}", "--log-level", "error"]
        if options.mode == "cluster":
            args += ["--redis-mode", "cluster"]
        rlsd = subprocess.Popen(args + options.extra, stderr=subprocess.DEVNULL)
        children.append(rlsd)
        wait_port(grpc)
        time.sleep(0.5)

        samples = []  # (time, KiB)
        sampling = threading.Event()

        def sample():
            while not sampling.is_set():
                samples.append((time.time(), rss_kib(rlsd.pid)))
                time.sleep(0.1)

        def late_gauges():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=2).read().decode()
            except OSError:
                return None
            values = {}
            for line in text.splitlines():
                for name in ("rlsd_redis_late_requests", "rlsd_redis_late_requests_let_go"):
                    if line.startswith(name + " "):
                        values[name] = float(line.split()[1])
            return values

        sampler = threading.Thread(target=sample)
        sampler.start()
        idle = rss_kib(rlsd.pid)
        log = os.path.join(work, "h2load.log")
        total = options.before_seconds + options.stop_seconds + options.after_seconds
        started = time.time()
        h2load = subprocess.Popen(
            ["h2load", "-c", str(options.connections), "-m", str(options.streams), "-t", "1",
             "-D", f"{int(total * 1000)}ms", "-H", "content-type: application/grpc",
             "-H", "te: trailers", *(["-H", f"grpc-timeout: {options.grpc_timeout}"] if options.grpc_timeout else []),
             "-d", body, f"--log-file={log}",
             f"http://127.0.0.1:{grpc}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(options.before_seconds)
        stopped = time.time()
        for node in masters:
            node.send_signal(signal.SIGSTOP)
        gauges_in_stop = []
        while time.time() < stopped + options.stop_seconds:
            time.sleep(1)
            gauges_in_stop.append(late_gauges())
        resumed = time.time()
        for node in masters:
            node.send_signal(signal.SIGCONT)
        out = h2load.communicate()[0].decode()
        ended = time.time()
        time.sleep(2)
        settled = rss_kib(rlsd.pid)
        sampling.set()
        sampler.join()
        gauges_end = late_gauges()

        phases = [("Redis running", started, stopped), ("Redis stopped", stopped, resumed),
                  ("after SIGCONT", resumed, ended)]
        latencies = {name: [] for name, _, _ in phases}
        with open(log) as f:
            for line in f:
                parts = line.split("\t")
                if len(parts) < 3:
                    continue
                at = int(parts[0]) / 1e6
                for name, start, end in phases:
                    if start <= at < end:
                        latencies[name].append(int(parts[2]) / 1000)
        print(f"# rlsd ({options.mode}) under h2load -c {options.connections} -m {options.streams}, "
              f"Redis stopped {options.stop_seconds:.0f} s; grpc-timeout {options.grpc_timeout or 'none'}; "
              f"flags: {' '.join(options.extra) or '-'}")
        print(f"idle RSS before the flood: {idle / 1024:.1f} MiB; 2 s after it: {settled / 1024:.1f} MiB")
        print("| phase | requests | req/s | p50 ms | p99 ms | max ms | RSS max MiB | RSS at end MiB |")
        print("|---|---|---|---|---|---|---|---|")
        for name, start, end in phases:
            values = sorted(latencies[name])
            rss = [kib for at, kib in samples if start <= at < end]
            print(f"| {name} | {len(values)} | {len(values) / max(end - start, 1e-9):.0f} | "
                  f"{percentile(values, 0.5):.2f} | {percentile(values, 0.99):.2f} | "
                  f"{(values[-1] if values else float('nan')):.2f} | "
                  f"{max(rss) / 1024 if rss else float('nan'):.1f} | "
                  f"{rss[-1] / 1024 if rss else float('nan'):.1f} |")
        held = [g.get("rlsd_redis_late_requests", 0) for g in gauges_in_stop if g]
        print(f"late requests awaited, sampled each second while stopped: {held}")
        print(f"gauges at the end: {gauges_end}")
        print("RSS every 100 ms (MiB, from the flood's start): " + " ".join(
            f"{kib / 1024:.0f}" for at, kib in samples if at >= started))
        summary = [line for line in out.splitlines() if line.startswith(("requests:", "status codes:"))]
        print("h2load: " + " / ".join(summary))
    finally:
        for child in reversed(children):
            try:
                child.send_signal(signal.SIGCONT)
                child.kill()
                child.wait()
            except OSError:
                pass


if __name__ == "__main__":
    main()
