"""Choosing the mesh for a target: compile the candidate meshes and rank those that fit by
their predicted step time (dry_run.py, roofline.py).

The candidates, compiled in this order:
  1. every (data, fsdp, tensor) split of the target's devices whose weights divide (tensor at
     most the head count), with scanned layers and no rematerialisation: scanning compiles one
     layer per stack, several times faster than unrolled layers, and computes the same;
  2. each split over 'data' that does not fit, again with mesh.shard_update (the optimiser's
     state split over 'data' too: less memory for no more arithmetic);
  3. each split that still does not fit, again with remat 'dots', then 'full' (more
     arithmetic for less memory: only worth it where memory is short), the update split
     where the batch is split over 'data';
  4. the best candidate with unrolled layers too (slower to compile; XLA may schedule the
     unrolled program better, or worse);
  5. where the best so far splits the batch over 'data' and not its update, it again with
     mesh.shard_update (fewer bytes for the update, for a reduce-scatter and an all-gather in
     place of an all-reduce: faster on some chips and meshes, slower on others).
The winner is then compiled with its eval step and search, as a plain target dry run.
"""

import dataclasses
import sys

import jax

from t2t_jax import cli

from t2t_jax import ConfigError
from t2t_jax.compile import dry_run as dry_run_lib
from t2t_jax.compile import targets


@dataclasses.dataclass
class Candidate:
  mesh: tuple[int, int, int]
  scan_layers: bool
  remat: str
  shard_update: bool = False
  result: dict | None = None  # The dry run's report; None when the candidate was refused.
  refused: str = ''  # Why it could not be built (a weight that does not divide, ...).

  @property
  def fits(self) -> bool:
    """Its train step fits (and, once compiled with them, its eval step and search)."""
    return bool(self.result) and self.result.get('fits', True) and (
        self.result['programs']['train_step']['fits'])

  @property
  def step_seconds(self) -> float:
    return self.result['prediction']['step_seconds'] if self.fits else float('inf')

  def as_dict(self) -> dict:
    row = {'mesh': list(self.mesh), 'scan_layers': self.scan_layers, 'remat': self.remat,
           'shard_update': self.shard_update, 'fits': self.fits}
    if self.refused:
      return {**row, 'refused': self.refused}
    train = self.result['programs']['train_step']
    row.update(needs_bytes=train['needs_bytes'], compile_seconds=train['compile_seconds'])
    if 'prediction' in self.result:
      prediction = self.result['prediction']
      row.update(step_seconds=prediction['step_seconds'], bound=prediction['bound'],
                 target_tokens_per_second=prediction['target_tokens_per_second'],
                 mfu=prediction['mfu'])
    return row


def splits(num_devices: int, num_heads: int, slices: int = 1) -> list[tuple[int, int, int]]:
  """(data, fsdp, tensor) meshes of `num_devices`: tensor divides the heads, and data is a
  multiple of the slices (only the data axis crosses the slow network)."""
  found = []
  for tensor in range(1, num_devices + 1):
    if num_devices % tensor or num_heads % tensor:
      continue
    rest = num_devices // tensor
    for fsdp in range(1, rest + 1):
      if rest % fsdp == 0 and (rest // fsdp) % slices == 0:
        found.append((rest // fsdp, fsdp, tensor))
  return found


def _configured(config, candidate: Candidate):
  trial = config.copy_and_resolve_references()
  trial.mesh.shape = candidate.mesh + (1,)
  trial.model.scan_layers, trial.model.remat = candidate.scan_layers, candidate.remat
  trial.mesh.shard_update = candidate.shard_update
  return trial


def _try(config, target: str, candidate: Candidate, log) -> Candidate:
  trial = _configured(config, candidate)
  try:
    candidate.result = dry_run_lib.dry_run(trial, target, evaluation=False)
  except (ConfigError, jax.errors.JaxRuntimeError) as e:  # The compiler's refusal too.
    candidate.refused = str(e).strip().splitlines()[0]
  log(candidate)
  return candidate


def search(config, target: str, print_progress: bool = False) -> list[Candidate]:
  """Every candidate compiled, the fitting ones first, fastest (predicted) first."""
  named = targets.parse(target)
  log = _progress if print_progress else (lambda candidate: None)
  config = config.copy_and_resolve_references()
  config.mesh.dcn_data = named.slices
  split = bool(config.mesh.get('shard_update', False))
  # The config's own mesh.shard_update, marked only on the meshes it applies to (data > 1).
  tried = [_try(config, target, Candidate(mesh, True, 'none', split and mesh[0] > 1), log)
           for mesh in splits(named.num_devices, config.model.num_heads, named.slices)]
  if not split:
    tried += [_try(config, target, Candidate(mesh, True, 'none', True), log)
              for mesh in _short(tried) if mesh[0] > 1]
  for remat in ('dots', 'full'):
    tried += [_try(config, target, Candidate(mesh, True, remat, mesh[0] > 1), log)
              for mesh in _short(tried)]
  fitting = [c for c in tried if c.fits]
  if fitting:
    best = min(fitting, key=lambda c: c.step_seconds)
    tried.append(_try(config, target, Candidate(best.mesh, False, best.remat,
                                                best.shard_update), log))
    best = min([c for c in tried if c.fits], key=lambda c: c.step_seconds)
    if best.mesh[0] > 1 and not split:
      tried.append(_try(config, target, dataclasses.replace(best, shard_update=True,
                                                            result=None), log))
  ranked = sorted(tried, key=lambda c: (not c.fits, c.step_seconds, c.mesh))
  for candidate in [c for c in ranked if c.fits]:  # With what an in-loop evaluation compiles.
    candidate.result = dry_run_lib.dry_run(_configured(config, candidate), target)
    if candidate.result['fits']:
      break  # The winner: the fastest whose eval step and search fit too.
    log(candidate)  # Its train step fits, its evaluation does not: the next one is tried.
  return sorted(ranked, key=lambda c: (not c.fits, c.step_seconds, c.mesh))


def _short(tried: list[Candidate]) -> list[tuple[int, int, int]]:
  """The meshes compiled without remat that no candidate of theirs fits yet (not refused)."""
  short = [c.mesh for c in tried if c.remat == 'none' and not c.fits and not c.refused
           and not any(d.mesh == c.mesh and d.fits for d in tried)]
  return list(dict.fromkeys(short))


def _progress(candidate: Candidate) -> None:
  row = candidate.as_dict()
  what = (f'refused: {row["refused"]}' if candidate.refused else
          f'needs {row["needs_bytes"] / 2**30:.2f} GiB, '
          + (f'predicted {1e3 * row["step_seconds"]:.1f} ms' if candidate.fits else 'does not fit')
          + f' (compiled in {row["compile_seconds"]:.0f} s)')
  print(f'mesh {candidate.mesh} scan_layers={candidate.scan_layers} remat={candidate.remat} '
        f'shard_update={candidate.shard_update}: {what}', file=sys.stderr, flush=True)


def table(ranked: list[Candidate]) -> str:
  """The candidates as a table, the best first."""
  lines = [f'{"rank":>4} {"data,fsdp,tensor":>16} {"scan":>5} {"remat":>5} {"update":>6} '
           f'{"needs GiB":>9} {"step ms":>8} {"tokens/s":>10} {"MFU":>6}  bound']
  for rank, candidate in enumerate(ranked, start=1):
    row = candidate.as_dict()
    mesh = ','.join(map(str, candidate.mesh))
    head = (f'{rank:>4} {mesh:>16} {str(candidate.scan_layers):>5} {candidate.remat:>5} '
            f'{"split" if candidate.shard_update else "whole":>6}')
    if candidate.refused:
      lines.append(f'{head}  refused: {candidate.refused}')
    elif not candidate.fits:
      lines.append(f'{head} {row["needs_bytes"] / 2**30:>9.2f}  does not fit')
    else:
      lines.append(f'{head} {row["needs_bytes"] / 2**30:>9.2f} {1e3 * row["step_seconds"]:>8.1f} '
                   f'{row["target_tokens_per_second"]:>10,} {100 * row["mfu"]:>5.1f}%  '
                   f'{row["bound"]}')
  return '\n'.join(lines)


def summary(ranked: list[Candidate]) -> dict:
  """One JSON-able record: the winner's whole dry run and every candidate's row."""
  best = ranked[0] if ranked and ranked[0].fits else None
  return {'best': best.result if best else None,
          'candidates': [c.as_dict() for c in ranked],
          **({} if best else {'null_reasons': {'best': 'no candidate fits the target'}})}


def command(config, target: str) -> None:
  """`--dry_run --dry_run_target=... --search_mesh`: progress lines, the ranked table and one
  JSON line; no candidate that fits ends the command with one line saying so."""
  ranked = search(config, target, print_progress=True)
  print(table(ranked), flush=True)
  print(cli.json_line(summary(ranked)), flush=True)
  if not ranked or not ranked[0].fits:
    raise ConfigError(f'no mesh of {target} fits {config.name}: every split of its devices was '
                      'compiled, with remat dots and full; raise config.opt.grad_accum_steps, '
                      'lower config.data.batch_tokens, or name a larger target')
