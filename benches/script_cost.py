#!/usr/bin/env python3
"""Redis's own cost of the store's script (lua/ratelimit.lua), for two versions side by side.

Sends redis-server the EVALSHA calls the Redis store sends for the 3-layer bench request (three
checks: edge, plan+key, endpoint+key; fixed windows, or `--algorithm` as the script names it:
gcra is the gRPC bench's default; limits that never fill; Redis's clock), and
reports for each script given, in the same run:

- `callgrind`: redis-server's instructions per call under `valgrind --tool=callgrind`, as
  benches/instructions.rs counts them: LOW and HIGH calls after the same warm-up, in two
  servers; (HIGH total - LOW total) / (HIGH - LOW). Deterministic up to Redis's timers.
- `usec`: Redis's own CPU per decision the issue's way, natively: `INFO commandstats` evalsha
  `usec_per_call` over `--calls` calls (reset before each), divided by the requests per call.
  Rounds alternate between the scripts on one server; the median and range are printed.

Scenarios (requests per call, and whose keys):
  shared16   16 requests of one client, as h2load's one fixed body coalesced (keys shared)
  distinct16 16 requests of 16 of 1000 clients, as benches/instructions.rs sends them
  one1       one request per call (no coalescing)

    python3 benches/script_cost.py [--rev REV | --script FILE]... [--modes callgrind,usec]
        [--scenarios shared16,distinct16,one1] [--rounds 3] [--calls 20000] [--algorithm fw]

`--rev REV` takes lua/ratelimit.lua at a git revision (e.g. `--rev HEAD~1 --rev HEAD`);
`--script FILE` a file. The period is 60 s (`--period-us`): a slower server (valgrind) would
otherwise roll most keys into a new window between calls. Asserts nothing but the answers
(every request allowed).
"""
import argparse, os, re, socket, statistics, subprocess, tempfile, time

SCENARIOS = {
    'shared16': (16, lambda i: [7] * 16),
    'distinct16': (16, lambda i: [(i * 16 + j) % 1000 for j in range(16)]),
    'one1': (1, lambda i: [i % 1000]),
}


def resp(args):
    out = [b'*%d\r\n' % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b'$%d\r\n%s\r\n' % (len(a), a))
    return b''.join(out)


class Conn:
    def __init__(self, port):
        for _ in range(1200):
            try:
                self.s = socket.create_connection(('127.0.0.1', port))
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError('redis-server did not start')
        self.f = self.s.makefile('rb')

    def call(self, *args):
        self.s.sendall(resp(args))
        return self.read()

    def pipeline(self, commands):
        self.s.sendall(b''.join(resp(c) for c in commands))
        return [self.read() for _ in commands]

    def read(self):
        line = self.f.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b'+':
            return rest.decode()
        if kind == b'-':
            raise RuntimeError(rest.decode())
        if kind == b':':
            return int(rest)
        if kind == b'$':
            n = int(rest)
            return None if n < 0 else self.f.read(n + 2)[:-2].decode()
        if kind == b'*':
            return [self.read() for _ in range(int(rest))]
        raise RuntimeError('unexpected reply %r' % line)


def keys_of(client):
    return ['bench:remote_address=10.0.%d.%d' % (client >> 8 & 255, client & 255),
            'bench:plan=pro:api_key=client-%d' % client,
            'bench:endpoint=search:api_key=client-%d' % client]


ALGORITHM = 'fw'


def call_args(clients, period_us):
    keys, requests = [], []
    for client in clients:
        requests += ['3', '']
        for key in keys_of(client):
            keys.append(key)
            requests += ['1', '1']
    # A burst as large as the limit, as the benches' config has for GCRA and token buckets.
    limits = ['1', ALGORITHM, '4000000000', str(period_us), '4000000000', '0']
    return [len(keys)] + keys + [''] + limits + [len(clients)] + requests


def check(reply, per_call):
    numbers = reply.split(' ')
    if len(numbers) != 1 + 9 * per_call or any(v != '1' for v in numbers[1::3]):
        raise RuntimeError('not every request allowed: %s' % reply[:200])
    return ' '.join(numbers[1:])


def start(port, wrapper=()):
    return subprocess.Popen(list(wrapper) + ['redis-server', '--port', str(port), '--bind',
                            '127.0.0.1', '--save', '', '--appendonly', 'no'],
                            stdout=subprocess.DEVNULL)


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def warm(conn, sha, period_us):
    for first in range(0, 1000, 16):
        conn.call('EVALSHA', sha, *call_args(range(first, min(first + 16, 1000)), period_us))


def callgrind_total(script, scenario, calls, period_us):
    log = tempfile.mktemp(prefix='rlsd-script-cost-', suffix='.log')
    port = free_port()
    server = start(port, ['valgrind', '--tool=callgrind', '--callgrind-out-file=/dev/null',
                          '--log-file=' + log])
    conn = Conn(port)
    sha = conn.call('SCRIPT', 'LOAD', script)
    warm(conn, sha, period_us)
    per_call, clients = SCENARIOS[scenario]
    for i in range(calls):
        check(conn.call('EVALSHA', sha, *call_args(clients(i), period_us)), per_call)
    try:
        conn.call('SHUTDOWN', 'NOSAVE')
    except (RuntimeError, OSError):
        pass
    server.wait()
    with open(log) as f:
        text = f.read()
    os.unlink(log)
    return int(re.search(r'Collected : ([\d,]+)', text).group(1).replace(',', ''))


def usec_per_call(conn, sha, scenario, calls, period_us):
    per_call, clients = SCENARIOS[scenario]
    conn.call('CONFIG', 'RESETSTAT')
    for first in range(0, calls, 64):
        batch = [['EVALSHA', sha] + call_args(clients(i), period_us)
                 for i in range(first, min(first + 64, calls))]
        for reply in conn.pipeline(batch):
            check(reply, per_call)
    stats = conn.call('INFO', 'commandstats')
    return float(re.search(r'cmdstat_evalsha:calls=\d+,usec=\d+,usec_per_call=([\d.]+)',
                           stats).group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--rev', action='append', default=[])
    parser.add_argument('--script', action='append', default=[])
    parser.add_argument('--modes', default='callgrind,usec')
    parser.add_argument('--scenarios', default='shared16,distinct16,one1')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--calls', type=int, default=20000)
    parser.add_argument('--low', type=int, default=50)
    parser.add_argument('--high', type=int, default=250)
    parser.add_argument('--period-us', type=int, default=60_000_000)
    parser.add_argument('--algorithm', default='fw', help='fw, gcra, tb, swc or swlc')
    args = parser.parse_args()
    global ALGORITHM
    ALGORITHM = args.algorithm
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scripts = [(rev, subprocess.check_output(['git', 'show', rev + ':lua/ratelimit.lua'],
                                             cwd=root, text=True)) for rev in args.rev]
    scripts += [(path, open(path).read()) for path in args.script]
    if not scripts:
        scripts = [('working tree', open(os.path.join(root, 'lua/ratelimit.lua')).read())]
    scenarios = args.scenarios.split(',')
    modes = args.modes.split(',')

    if 'callgrind' in modes:
        print('# Redis instructions per call (callgrind on redis-server, %d - %d calls)\n'
              % (args.high, args.low))
        print('| script | scenario | instr/call | instr/request |\n|---|---|---:|---:|')
        for scenario in scenarios:
            for name, script in scripts:
                low = callgrind_total(script, scenario, args.low, args.period_us)
                high = callgrind_total(script, scenario, args.high, args.period_us)
                per_call = (high - low) / (args.high - args.low)
                print('| %s | %s | %.0f | %.0f |' % (name, scenario, per_call,
                                                     per_call / SCENARIOS[scenario][0]), flush=True)

    if 'usec' in modes:
        port = free_port()
        server = start(port)
        conn = Conn(port)
        shas = [conn.call('SCRIPT', 'LOAD', script) for _, script in scripts]
        warm(conn, shas[0], args.period_us)
        print('\n# Redis CPU per decision, usec_per_call / requests per call (%d calls, %d '
              'alternating rounds)\n' % (args.calls, args.rounds))
        print('| script | scenario | µs/decision, median (range) |\n|---|---|---|')
        for scenario in scenarios:
            figures = {name: [] for name, _ in scripts}
            for _ in range(args.rounds):
                for (name, _), sha in zip(scripts, shas):
                    usec = usec_per_call(conn, sha, scenario, args.calls, args.period_us)
                    figures[name].append(usec / SCENARIOS[scenario][0])
            for name, values in figures.items():
                print('| %s | %s | %.2f (%.2f–%.2f) |' % (name, scenario, statistics.median(values),
                                                          min(values), max(values)), flush=True)
        try:
            conn.call('SHUTDOWN', 'NOSAVE')
        except (RuntimeError, OSError):
            pass
        server.wait()


if __name__ == '__main__':
    main()
