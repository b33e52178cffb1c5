import * as React from 'react';

import { IJob, IRun, ISweep } from './api';
import { Bar, Sparkline } from './charts';
import { ago, basename, duration, metric } from './format';
import { SweepCard, sweepActive } from './sweeps';

export interface IRunActions {
  onStop: (run: IRun) => void;
  onRemove: (run: IRun) => void;
  onOpen: (run: IRun) => void;
  onStopSweep: (sweep: ISweep) => void;
}

/** The validation metric a finished card shows: an accuracy-like one first, else a loss. */
export function bestMetric(run: IRun): [string, number] | null {
  const entries = Object.entries(run.best ?? {});
  const notLoss = entries.find(([name]) => !/loss|err/.test(name));
  return notLoss ?? entries[0] ?? null;
}

/**
 * Whether the card's button cancels the job at once (scancel; local: its controller) rather
 * than asking it to stop at its next step: a job still waiting in the queue has no step to
 * stop at, and a job already asked to stop is cancelled by a second request (gpunb.jobs).
 */
export function cancels(run: IRun): boolean {
  return !!run.job && (run.status === 'queued' || !!run.stop_requested);
}

/** `1m 05s · 1,125 steps · MFU 31.5% · best val_acc 0.953 · 5 min ago` */
export function finishedSummary(run: IRun): string {
  const parts: string[] = [];
  if (run.started_at && run.ended_at) {
    parts.push(duration(run.ended_at - run.started_at));
  }
  parts.push(`${(run.step ?? 0).toLocaleString('en-US')} steps`);
  const mfu = run.latest?.mfu;
  if (typeof mfu === 'number') {
    parts.push(`MFU ${(100 * mfu).toFixed(1)}%`);
  }
  const best = bestMetric(run);
  if (best) {
    parts.push(`best ${best[0]} ${metric(best[1])}`);
  }
  const when = ago(run.ended_at ?? run.updated_at);
  if (when) {
    parts.push(when);
  }
  return parts.join(' · ');
}

function RunRow(props: {
  run: IRun;
  losses: number[];
  actions: IRunActions;
  open: boolean;
}): JSX.Element {
  const { run, actions } = props;
  const running = run.status === 'running';
  const queued = run.status === 'queued';
  const stopping = running && run.stop_requested;
  const cancel = cancels(run);
  const loss = run.latest?.loss;
  const steps = run.total_steps
    ? `step ${run.step ?? 0} / ${run.total_steps}`
    : `step ${run.step ?? 0}`;
  const button = (
    label: string,
    className: string,
    title: string,
    action: (run: IRun) => void,
    disabled = false
  ) => (
    <button
      className={`${className} jp-mod-styled`}
      disabled={disabled}
      title={title}
      onClick={event => {
        event.stopPropagation(); // not also a click on the card
        action(run);
      }}
    >
      {label}
    </button>
  );
  return (
    <li
      className={`jp-gpunb-run${props.open ? ' jp-mod-open' : ''}`}
      data-run-id={run.id}
      data-status={run.status}
      role="button"
      tabIndex={0}
      title="Show this run's curves and configuration"
      onClick={() => actions.onOpen(run)}
      onKeyDown={event => event.key === 'Enter' && actions.onOpen(run)}
    >
      <div className="jp-gpunb-card-title">
        <span className="jp-gpunb-ellipsis">{run.name}</span>
        <span className={`jp-gpunb-status jp-gpunb-status-${run.status}`}>
          {stopping ? 'stopping…' : run.status}
        </span>
      </div>
      {run.notebook ? (
        <div className="jp-gpunb-muted" title={run.notebook}>
          {basename(run.notebook)}
          {run.device ? ` · ${run.device}` : ''}
        </div>
      ) : null}
      {run.job ? (
        <div className="jp-gpunb-muted jp-gpunb-job">{jobText(run.job, queued)}</div>
      ) : null}
      {running ? (
        <Bar
          label={steps}
          percent={(run.progress ?? 0) * 100}
          detail={
            run.progress === null || run.progress === undefined
              ? ''
              : `${Math.round(run.progress * 100)} %` +
                (run.eta_s ? ` · ETA ${duration(run.eta_s)}` : '')
          }
        />
      ) : queued ? (
        <div className="jp-gpunb-run-summary">
          {`submitted ${ago(run.started_at)}`}
        </div>
      ) : (
        <div className="jp-gpunb-run-summary">{finishedSummary(run)}</div>
      )}
      {!running && !queued && run.stop_reason ? (
        <div className="jp-gpunb-muted jp-gpunb-stop-reason">{run.stop_reason}</div>
      ) : null}
      <Sparkline values={props.losses} title="Training loss" />
      <div className="jp-gpunb-run-footer">
        <span className="jp-gpunb-muted">
          {typeof loss === 'number' ? `loss ${metric(loss)}` : ''}
        </span>
        {running || queued
          ? button(
              cancel ? 'Cancel' : 'Stop',
              'jp-gpunb-stop jp-mod-warn',
              cancel
                ? queued
                  ? 'Take this job off the queue'
                  : 'Cancel this job now (its newest checkpoint stays)'
                : 'Stop this run cleanly at its next log interval',
              actions.onStop,
              stopping && !cancel // a run in the kernel: asked once, it stops on its own
            )
          : button(
              'Remove',
              'jp-gpunb-remove',
              'Remove this run and its metrics from the registry',
              actions.onRemove
            )}
      </div>
      {run.error ? <div className="jp-gpunb-error">{run.error}</div> : null}
    </li>
  );
}

/**
 * "slurm job 4242 · 2 nodes × 8 GPUs · PENDING (Priority)": the scheduler's state and reason
 * only while the job waits (the card's status says the rest; the registry keeps the last
 * state the scheduler was asked for, PENDING even after the job started).
 */
export function jobText(job: IJob, waiting: boolean): string {
  const where = job.id ? `${job.cluster} job ${job.id}` : `${job.cluster} job`;
  const unit = job.gpus_per_node ? 'GPU' : 'process';
  const count = job.tasks_per_node;
  const size = `${job.nodes} node${job.nodes === 1 ? '' : 's'} × ${count} ${unit}${count === 1 ? '' : unit === 'GPU' ? 's' : 'es'}`;
  const state =
    waiting && job.state
      ? ` · ${job.state}${job.reason ? ` (${job.reason})` : ''}`
      : '';
  return `${where} · ${size}${state}`;
}

type Card = { run: IRun } | { sweep: ISweep };

/** Whether a card's run waits or trains (a sweep's: any of its trials), and when it began. */
function cardOrder(card: Card): [number, number] {
  if ('sweep' in card) {
    return [Number(sweepActive(card.sweep)), card.sweep.updated_at ?? 0];
  }
  const { run } = card;
  return [
    Number(run.status === 'running' || run.status === 'queued'),
    run.started_at ?? 0
  ];
}

/**
 * The runs of every kernel, newest first, running runs and waiting jobs on top; a sweep's
 * trials are one card, the sweep's, with the trials inside.
 */
export function Runs(props: {
  runs: IRun[];
  sweeps: ISweep[];
  losses: Map<string, number[]>;
  error: string | null;
  actions: IRunActions;
  openId: string | null; // the run whose curves are shown below the list
}): JSX.Element {
  const inSweep = new Set(
    props.sweeps.flatMap(sweep => sweep.runs.map(trial => trial.id))
  );
  const cards: Card[] = [
    ...props.runs.filter(run => !inSweep.has(run.id)).map(run => ({ run })),
    ...props.sweeps.map(sweep => ({ sweep }))
  ];
  cards.sort((a, b) => {
    const [activeA, timeA] = cardOrder(a);
    const [activeB, timeB] = cardOrder(b);
    return activeB - activeA || timeB - timeA;
  });
  return (
    <section className="jp-gpunb-section">
      <h3 className="jp-gpunb-heading">Runs</h3>
      {props.error ? (
        <div className="jp-gpunb-error jp-gpunb-runs-error">{props.error}</div>
      ) : null}
      {cards.length === 0 && !props.error ? (
        <div className="jp-gpunb-muted">
          No training runs yet. Runs started with %%gputrain or gpunb.Trainer
          appear here.
        </div>
      ) : (
        <ul className="jp-gpunb-runs">
          {cards.map(card =>
            'sweep' in card ? (
              <SweepCard
                key={`sweep:${card.sweep.name}`}
                sweep={card.sweep}
                actions={props.actions}
                onStop={props.actions.onStopSweep}
              />
            ) : (
              <RunRow
                key={card.run.id}
                run={card.run}
                losses={props.losses.get(card.run.id) ?? []}
                actions={props.actions}
                open={card.run.id === props.openId}
              />
            )
          )}
        </ul>
      )}
    </section>
  );
}
