"""Starts N processes of one command on this machine, as one multi-process JAX run.

  python launch/local.py --num_processes=2 --devices_per_process=4 -- \
      python -m t2t_jax.main --config=configs/tiny.py --workdir=/tmp/t2t_2proc

Each process gets T2T_COORDINATOR_ADDRESS (127.0.0.1 and a free port), T2T_NUM_PROCESSES and
T2T_PROCESS_ID, which t2t_jax.main passes to jax.distributed.initialize. With
--devices_per_process, each process simulates that many CPU devices (for tests and for trying a
multi-host layout on a laptop). Output lines are prefixed with the process index. If one process
fails, the others are stopped and its exit status is returned. No training logic lives here.
"""

import argparse
import os
import socket
import subprocess
import sys
import threading


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _relay(index: int, stream, sink) -> None:
  for line in iter(stream.readline, ''):
    sink.write(f'[{index}] {line}')
    sink.flush()


def launch(command: list[str], num_processes: int, devices_per_process: int = 0,
           port: int = 0) -> int:
  """Runs `command` as `num_processes` cooperating processes; returns the first failure's code."""
  address = f'127.0.0.1:{port or free_port()}'
  processes, relays = [], []
  for index in range(num_processes):
    env = dict(os.environ, T2T_COORDINATOR_ADDRESS=address,
               T2T_NUM_PROCESSES=str(num_processes), T2T_PROCESS_ID=str(index))
    if devices_per_process:
      env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                          f' --xla_force_host_platform_device_count={devices_per_process}')
      env['JAX_PLATFORMS'] = 'cpu'
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    processes.append(process)
    relays.append(threading.Thread(target=_relay, args=(index, process.stdout, sys.stdout)))
    relays[-1].start()
  status = 0
  remaining = list(processes)
  while remaining:
    for process in list(remaining):
      try:
        code = process.wait(timeout=0.5)
      except subprocess.TimeoutExpired:
        continue
      remaining.remove(process)
      if code and not status:
        status = code
        print(f'launch/local.py: process {processes.index(process)} exited with status {code}; '
              'stopping the others', file=sys.stderr, flush=True)
        for other in remaining:
          other.terminate()
  for relay in relays:
    relay.join()
  return status


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   usage='%(prog)s [options] -- command ...')
  parser.add_argument('--num_processes', type=int, default=2, help='Processes to start.')
  parser.add_argument('--devices_per_process', type=int, default=0,
                      help='Simulated CPU devices per process; 0 uses the real devices.')
  parser.add_argument('--port', type=int, default=0, help='Coordinator port; 0 picks a free one.')
  parser.add_argument('command', nargs=argparse.REMAINDER, help='The command, after --.')
  args = parser.parse_args()
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not command:
    parser.error('give the command to run after --')
  if args.num_processes < 1:
    parser.error(f'--num_processes must be >= 1, got {args.num_processes}')
  sys.exit(launch(command, args.num_processes, args.devices_per_process, args.port))


if __name__ == '__main__':
  main()
