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
