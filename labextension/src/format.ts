/** Small formatters shared by the GPU cards and the run list. */

export function basename(path: string | null | undefined): string {
  return path ? path.split('/').pop() || path : '';
}

export function gib(mb: number | null | undefined): string {
  return typeof mb === 'number' ? (mb / 1024).toFixed(1) : '?';
}

const pad = (n: number): string => String(n).padStart(2, '0');

/** `45s`, `12m 05s`, `1h 02m`: the same text as gpunb.units.format_duration. */
export function duration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) {
    return '';
  }
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  if (h > 0) {
    return `${h}h ${pad(m)}m`;
  }
  return m > 0 ? `${m}m ${pad(s % 60)}s` : `${s}s`;
}

/** How long ago a UNIX time (seconds) was: `just now`, `5 min ago`, `3 h ago`, `2 days ago`. */
export function ago(time: number | null | undefined, now = Date.now() / 1000): string {
  if (!time) {
    return '';
  }
  const s = Math.max(0, now - time);
  if (s < 60) {
    return 'just now';
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min ago`;
  }
  if (s < 86400) {
    return `${Math.floor(s / 3600)} h ago`;
  }
  const days = Math.floor(s / 86400);
  return days === 1 ? 'yesterday' : `${days} days ago`;
}

/** A metric value in 4 significant digits, as the Python views print it. */
export function metric(value: number | null | undefined): string {
  return typeof value === 'number' ? String(Number(value.toPrecision(4))) : '-';
}

export function number(value: number | null | undefined, digits = 0): string {
  return typeof value === 'number' ? value.toFixed(digits) : '?';
}
