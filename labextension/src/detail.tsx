import * as React from 'react';

import { IPoint, IRunDetail } from './api';
import { ISeries, LineChart } from './charts';
import { basename, duration } from './format';
import { finishedSummary, IRunActions } from './runs';

// Bookkeeping, not curves worth a chart.
const NOT_CHARTED = new Set(['step', 't', 'epoch', 'steps', 'elapsed_s']);

/**
 * Each logged metric's (step, value) points; `loss` and `val_loss` share one
 * chart; metrics that never changed (a constant learning rate) get none.
 */
export function charts(history: IPoint[]): { title: string; series: ISeries[] }[] {
  const points = new Map<string, [number, number][]>();
  for (const row of history) {
    for (const [name, value] of Object.entries(row)) {
      if (!NOT_CHARTED.has(name) && typeof value === 'number') {
        points.set(name, [...(points.get(name) ?? []), [row.step, value]]);
      }
    }
  }
  const charted: { title: string; series: ISeries[] }[] = [];
  const losses = ['loss', 'val_loss'].filter(name => points.has(name));
  if (losses.length) {
    charted.push({
      title: 'loss',
      series: losses.map(name => ({ name, points: points.get(name)! }))
    });
  }
  for (const [name, values] of points) {
    const changed = values.some(([, value]) => value !== values[0][1]);
    if (!losses.includes(name) && changed) {
      charted.push({ title: name, series: [{ name, points: values }] });
    }
  }
  return charted;
}

function configText(value: unknown): string {
  return typeof value === 'string' ? value : JSON.stringify(value);
}

/** One run in the panel: its curves (every logged metric) and its configuration. */
export function RunDetail(props: {
  run: IRunDetail;
  actions: IRunActions;
  onClose: () => void;
}): JSX.Element {
  const { run } = props;
  const running = run.status === 'running';
  const section = React.useRef<HTMLElement>(null);
  React.useEffect(() => {
    // opened below the list of runs: brought into view once, not at every poll
    section.current?.scrollIntoView({ block: 'nearest' });
  }, [run.id]);
  return (
    <section
      className="jp-gpunb-section jp-gpunb-detail"
      data-run-id={run.id}
      ref={section}
    >
      <div className="jp-gpunb-detail-bar">
        <button
          className="jp-gpunb-back jp-mod-styled"
          onClick={props.onClose}
          title="Close this run's curves and configuration"
        >
          Close
        </button>
        {running ? null : (
          <button
            className="jp-gpunb-remove jp-mod-styled"
            onClick={() => props.actions.onRemove(run)}
            title="Remove this run and its metrics from the registry"
          >
            Remove
          </button>
        )}
      </div>
      <div className="jp-gpunb-card-title">
        <span className="jp-gpunb-ellipsis" title={run.id}>
          {run.name}
        </span>
        <span className={`jp-gpunb-status jp-gpunb-status-${run.status}`}>
          {run.status}
        </span>
      </div>
      <div className="jp-gpunb-muted">
        {[basename(run.notebook), run.device].filter(Boolean).join(' · ')}
      </div>
      <div className="jp-gpunb-run-summary">
        {running
          ? `step ${run.step ?? 0}${run.total_steps ? ` / ${run.total_steps}` : ''}` +
            (run.eta_s ? ` · ETA ${duration(run.eta_s)}` : '')
          : finishedSummary(run)}
      </div>
      {run.error ? <div className="jp-gpunb-error">{run.error}</div> : null}
      {run.history.length === 0 ? (
        <div className="jp-gpunb-muted">No metrics were logged.</div>
      ) : (
        charts(run.history).map(chart => (
          <LineChart key={chart.title} title={chart.title} series={chart.series} />
        ))
      )}
      <h3 className="jp-gpunb-heading">Configuration</h3>
      <table className="jp-gpunb-config">
        <tbody>
          {Object.entries(run.config ?? {}).map(([key, value]) => (
            <tr key={key}>
              <th>{key}</th>
              <td>{configText(value)}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </section>
  );
}
