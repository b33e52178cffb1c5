import * as React from 'react';

import { ISweep, ITrial } from './api';
import { metric } from './format';
import { cancels, IRunActions } from './runs';

/** Whether a sweep's card offers to stop the whole sweep: while any trial waits or runs. */
export function sweepActive(sweep: ISweep): boolean {
  return sweep.state === 'running' || sweep.state === 'stopping';
}

/** `3 / 8 trials · best val_loss 0.412 (trial 2)` */
export function sweepSummary(sweep: ISweep): string {
  const parts = [`${sweep.done} / ${sweep.trials} trials`];
  if (sweep.best) {
    parts.push(
      `best ${sweep.monitor} ${metric(sweep.best.value)} (trial ${sweep.best.trial})`
    );
  }
  return parts.join(' · ');
}

function TrialRow(props: {
  trial: ITrial;
  best: boolean;
  actions: IRunActions;
}): JSX.Element {
  const { trial, actions } = props;
  const active = trial.status === 'running' || trial.status === 'queued';
  const cancel = cancels(trial);
  const detail =
    trial.value !== null
      ? metric(trial.value)
      : trial.status === 'running'
        ? typeof trial.progress === 'number'
          ? `${Math.round(trial.progress * 100)} %`
          : `step ${trial.step ?? 0}`
        : '';
  return (
    <li
      className={`jp-gpunb-trial${props.best ? ' jp-mod-best' : ''}`}
      data-run-id={trial.id}
      data-state={trial.state}
      role="button"
      tabIndex={0}
      title={`step ${trial.step ?? 0}${trial.total_steps ? ` / ${trial.total_steps}` : ''}: show this trial's curves and configuration`}
      onClick={event => {
        event.stopPropagation();
        actions.onOpen(trial);
      }}
    >
      <span className="jp-gpunb-trial-number">{`trial ${trial.trial}`}</span>
      <span className={`jp-gpunb-status jp-gpunb-status-${trial.status}`}>
        {trial.state}
      </span>
      <span className="jp-gpunb-trial-value">{detail}</span>
      {active ? (
        <button
          className="jp-gpunb-stop jp-mod-warn jp-mod-styled"
          disabled={trial.state === 'stopping' && !cancel}
          title={
            cancel
              ? 'Cancel this trial now (its newest checkpoint stays)'
              : 'Stop this trial cleanly at its next step'
          }
          onClick={event => {
            event.stopPropagation();
            actions.onStop(trial);
          }}
        >
          {cancel ? 'Cancel' : 'Stop'}
        </button>
      ) : null}
    </li>
  );
}

/** One sweep: its name, state, trials ended of all, the best value so far, and its trials inside. */
export function SweepCard(props: {
  sweep: ISweep;
  actions: IRunActions;
  onStop: (sweep: ISweep) => void;
}): JSX.Element {
  const { sweep, actions } = props;
  const stoppable = sweep.state === 'running';
  return (
    <li
      className="jp-gpunb-run jp-gpunb-sweep"
      data-sweep={sweep.name}
      data-state={sweep.state}
    >
      <div className="jp-gpunb-card-title">
        <span className="jp-gpunb-ellipsis">{`sweep ${sweep.name}`}</span>
        <span
          className={`jp-gpunb-status jp-gpunb-status-${sweepActive(sweep) ? 'running' : 'completed'}`}
        >
          {sweep.state === 'stopping' ? 'stopping…' : sweep.state}
        </span>
      </div>
      <div className="jp-gpunb-run-summary jp-gpunb-sweep-summary">
        {sweepSummary(sweep)}
      </div>
      {sweep.stop_reason && !stoppable ? (
        <div className="jp-gpunb-muted jp-gpunb-stop-reason">
          {sweep.stop_reason}
        </div>
      ) : null}
      <ul className="jp-gpunb-trials">
        {sweep.runs.map(trial => (
          <TrialRow
            key={trial.id}
            trial={trial}
            best={trial.id === sweep.best?.id}
            actions={actions}
          />
        ))}
      </ul>
      {sweepActive(sweep) ? (
        <div className="jp-gpunb-run-footer">
          <span className="jp-gpunb-muted">{sweep.monitor}</span>
          <button
            className="jp-gpunb-stop jp-gpunb-stop-sweep jp-mod-warn jp-mod-styled"
            disabled={!stoppable}
            title="Stop the sweep: no more trials, the running ones stop at their next step with their checkpoints"
            onClick={() => props.onStop(sweep)}
          >
            Stop sweep
          </button>
        </div>
      ) : null}
    </li>
  );
}
