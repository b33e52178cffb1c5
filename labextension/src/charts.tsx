import * as React from 'react';

/** A horizontal bar filled to `percent` (0..100), with a label on top. */
export function Bar(props: {
  label: string;
  percent: number | undefined;
  detail: string;
}): JSX.Element {
  const percent = Math.max(0, Math.min(100, props.percent ?? 0));
  return (
    <div className="jp-gpunb-bar" title={`${props.label}: ${props.detail}`}>
      <div className="jp-gpunb-bar-text">
        <span>{props.label}</span>
        <span>{props.detail}</span>
      </div>
      <div className="jp-gpunb-bar-track">
        <div className="jp-gpunb-bar-fill" style={{ width: `${percent}%` }} />
      </div>
    </div>
  );
}

/**
 * A line through `values`, scaled to the box. With `max` the scale is fixed
 * (0..max, e.g. percentages); without it, it spans the values' own range.
 */
export function Sparkline(props: {
  values: number[];
  max?: number;
  title: string;
}): JSX.Element | null {
  const values = props.values.filter(v => isFinite(v));
  if (values.length < 2) {
    return null;
  }
  const lo = props.max === undefined ? Math.min(...values) : 0;
  const hi = props.max === undefined ? Math.max(...values) : props.max;
  const span = hi - lo || 1;
  const points = values
    .map((v, i) => {
      const x = (i / (values.length - 1)) * 100;
      const y = 22 - ((v - lo) / span) * 20;
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    })
    .join(' ');
  return (
    <svg
      className="jp-gpunb-sparkline"
      viewBox="0 0 100 24"
      preserveAspectRatio="none"
      role="img"
      aria-label={props.title}
    >
      <title>{props.title}</title>
      <polyline points={points} />
    </svg>
  );
}

/** One named line of (x, y) points. */
export interface ISeries {
  name: string;
  points: [number, number][];
}

/**
 * Lines against step with the y range and the first and last step written at the
 * edges: the detail view's curves. Colours come from the theme (see base.css).
 */
export function LineChart(props: {
  title: string;
  series: ISeries[];
}): JSX.Element | null {
  const series = props.series
    .map(s => ({
      name: s.name,
      points: s.points.filter(([x, y]) => isFinite(x) && isFinite(y))
    }))
    .filter(s => s.points.length > 0);
  if (series.length === 0) {
    return null;
  }
  const all = series.flatMap(s => s.points);
  const [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  const [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  // A loss that falls by orders of magnitude reads better on a log scale (as gpunb.charts does).
  const log = y0 > 0 && y1 / y0 > 100;
  const f = (y: number) => (log ? Math.log10(y) : y);
  const [f0, f1] = [f(y0), f(y1)];
  const [w, h, left, top] = [200, 70, 2, 4];
  const sx = (x: number) => left + ((x - x0) / (x1 - x0 || 1)) * (w - 2 * left);
  const sy = (y: number) => top + (1 - (f(y) - f0) / (f1 - f0 || 1)) * (h - 2 * top);
  const label = (v: number) => String(Number(v.toPrecision(3)));
  return (
    <figure className="jp-gpunb-chart" data-metric={props.title}>
      <figcaption className="jp-gpunb-chart-caption">
        <span>{props.title}</span>
        <span className="jp-gpunb-muted">
          {label(y0)} – {label(y1)}
          {log ? ' (log)' : ''}
        </span>
      </figcaption>
      <svg viewBox={`0 0 ${w} ${h}`} preserveAspectRatio="none" role="img">
        <title>{`${props.title} by step`}</title>
        <rect className="jp-gpunb-chart-frame" x={0} y={0} width={w} height={h} />
        {series.map((s, i) => (
          <polyline
            key={s.name}
            className={`jp-gpunb-series-${i % 3}`}
            points={s.points
              .map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`)
              .join(' ')}
          />
        ))}
      </svg>
      <div className="jp-gpunb-chart-axis jp-gpunb-muted">
        <span>step {x0}</span>
        <span>
          {series.length > 1
            ? series.map((s, i) => (
                <span key={s.name} className={`jp-gpunb-legend-${i % 3}`}>
                  {' '}
                  ● {s.name}
                </span>
              ))
            : null}
        </span>
        <span>{x1}</span>
      </div>
    </figure>
  );
}
