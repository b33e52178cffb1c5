import * as React from 'react';

import { IRun } from './api';
import { Bar, Sparkline } from './charts';
import { basename, duration } from './format';

function RunRow(props: {
  run: IRun;
  losses: number[];
  onStop: (run: IRun) => void;
}): JSX.Element {
  const { run } = props;
  const running = run.status === 'running';
  const stopping = running && run.stop_requested;
  const loss = run.latest?.loss;
  const steps = run.total_steps
    ? `step ${run.step ?? 0} / ${run.total_steps}`
    : `step ${run.step ?? 0}`;
  return (
    <li className="jp-gpunb-run" data-run-id={run.id} data-status={run.status}>
      <div className="jp-gpunb-card-title">
        <span className="jp-gpunb-ellipsis" title={run.id}>
          {run.name}
        </span>
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
      ) : null}
      <Sparkline values={props.losses} title="Training loss" />
      <div className="jp-gpunb-run-footer">
        <span className="jp-gpunb-muted">
          {typeof loss === 'number' ? `loss ${loss.toPrecision(4)}` : ''}
        </span>
        {running ? (
          <button
            className="jp-gpunb-stop jp-mod-styled jp-mod-warn"
            disabled={stopping}
            onClick={() => props.onStop(run)}
            title="Stop this run cleanly at its next log interval"
          >
            Stop
          </button>
        ) : null}
      </div>
      {run.error ? <div className="jp-gpunb-error">{run.error}</div> : null}
    </li>
  );
}

/** The runs of every kernel, newest first, running ones on top. */
export function Runs(props: {
  runs: IRun[];
  losses: Map<string, number[]>;
  onStop: (run: IRun) => void;
}): JSX.Element {
  const runs = [...props.runs].sort(
    (a, b) =>
      Number(b.status === 'running') - Number(a.status === 'running') ||
      (b.started_at ?? 0) - (a.started_at ?? 0)
  );
  return (
    <section className="jp-gpunb-section">
      <h3 className="jp-gpunb-heading">Runs</h3>
      {runs.length === 0 ? (
        <div className="jp-gpunb-muted">
          No training runs yet. Runs started with %%gputrain or gpunb.Trainer
          appear here.
        </div>
      ) : (
        <ul className="jp-gpunb-runs">
          {runs.map(run => (
            <RunRow
              key={run.id}
              run={run}
              losses={props.losses.get(run.id) ?? []}
              onStop={props.onStop}
            />
          ))}
        </ul>
      )}
    </section>
  );
}
