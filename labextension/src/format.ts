/** Small formatters shared by the GPU cards and the run list. */

export function basename(path: string | null | undefined): string {
  return path ? path.split('/').pop() || path : '';
}

export function gib(mb: number | null | undefined): string {
  return typeof mb === 'number' ? (mb / 1024).toFixed(1) : '?';
}

export function duration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) {
    return '';
  }
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  if (h > 0) {
    return `${h}h ${m}m`;
  }
  return m > 0 ? `${m}m ${s % 60}s` : `${s}s`;
}

export function number(value: number | null | undefined, digits = 0): string {
  return typeof value === 'number' ? value.toFixed(digits) : '?';
}
