import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** One process on a GPU; kernel_id and notebook are set when it is one of this server's kernels. */
export interface IGpuProcess {
  pid: number;
  used_memory_mb?: number | null; // null where the driver cannot attribute memory
  kernel_id?: string;
  notebook?: string | null;
}

/** One GPU (or MIG instance) as NVML sees it; a field the device does not support is absent. */
export interface IGpu {
  index: number | string; // "0:1" for MIG instance 1 of GPU 0
  parent_index?: number; // a MIG instance's GPU
  name?: string; // name and uuid too are absent when NVML cannot read them
  uuid?: string;
  utilization_gpu?: number;
  memory_used_mb?: number;
  memory_total_mb?: number;
  power_w?: number;
  power_limit_w?: number;
  temperature_c?: number;
  processes?: IGpuProcess[];
}

/** A stable key for a GPU across polls. */
export function gpuKey(gpu: IGpu): string {
  return gpu.uuid ?? `index-${gpu.index}`;
}

export interface IHost {
  cpu_percent?: number;
  cpu_count?: number;
  ram_used_mb?: number;
  ram_total_mb?: number;
  ram_percent?: number;
}

/** GET gpunb/api/devices */
export interface IDevices {
  time: number;
  nvidia: boolean;
  reason?: string;
  driver?: string;
  host: IHost;
  gpus: IGpu[];
}

export type RunStatus =
  | 'queued'
  | 'running'
  | 'completed'
  | 'stopped'
  | 'interrupted'
  | 'failed'
  | 'cancelled'
  | 'lost'; // a job its scheduler no longer knows (its id forgotten or reused)

/** A run that trains as a job (gpunb.jobs): where, how large, and the scheduler's state. */
export interface IJob {
  cluster: string; // "local" or "slurm"
  id?: string | null; // the scheduler's job id
  nodes: number;
  tasks_per_node: number;
  gpus_per_node: number;
  state?: string | null; // PENDING, RUNNING, REQUEUED ... (Slurm's words)
  reason?: string | null; // why a pending job waits (Priority, Resources ...)
}

/** One row of GET gpunb/api/runs */
export interface IRun {
  id: string;
  name: string;
  notebook?: string | null;
  status: RunStatus;
  progress?: number | null;
  step?: number | null;
  total_steps?: number | null;
  eta_s?: number | null;
  latest?: { [metric: string]: number | null }; // null for a non-finite value
  device?: string | null;
  error?: string | null;
  stop_reason?: string | null; // a stopped or cancelled run: who or what ended it, in words
  stop_requested?: boolean;
  started_at?: number | null;
  ended_at?: number | null;
  updated_at?: number | null;
  best?: { [metric: string]: number }; // each validation metric's best value, once finished
  losses?: [number, number][]; // running runs: the newest (step, loss) pairs
  config?: { [key: string]: unknown };
  job?: IJob | null;
  sweep?: ISweepTag | null; // a sweep's trial: which sweep, which trial
}

/** What a sweep's trial records of its sweep (TrainConfig.sweep). */
export interface ISweepTag {
  name: string;
  trial: number;
  trials: number; // the trials the sweep asks for
  monitor: string; // its objective, e.g. val_loss
  direction: 'minimize' | 'maximize';
}

/** One trial in a sweep's card: its run, its state in the sweep's words, its value. */
export interface ITrial extends IRun {
  trial: number;
  state: string; // complete, pruned, stopping, or the run's status
  value: number | null; // the monitored value of a completed trial
}

/** One sweep of GET gpunb/api/runs: its trials grouped in one card. */
export interface ISweep {
  name: string;
  trials: number;
  done: number; // trials that ended
  monitor: string;
  direction: 'minimize' | 'maximize';
  best: { trial: number; value: number; id: string } | null;
  state: 'running' | 'stopping' | 'stopped' | 'completed' | 'incomplete';
  stop_reason: string | null; // the stop of the whole sweep, in words
  started_at: number | null;
  updated_at: number | null;
  runs: ITrial[]; // by trial number
}

/** One logged point: step, time and whatever metrics were logged there. */
export interface IPoint {
  step: number;
  t: number;
  [metric: string]: number | null;
}

/** GET gpunb/api/runs/<id>: the run and its logged metrics. */
export interface IRunDetail extends IRun {
  history: IPoint[];
}

/**
 * Call the gpunb server extension at `<base_url>/gpunb/api/<endPoint>`.
 *
 * Throws a `ServerConnection.ResponseError` carrying the server's message on a non-2xx reply,
 * or the HTTP status and the start of the body when the reply is not JSON.
 */
export async function requestAPI<T>(
  endPoint: string,
  init: RequestInit = {}
): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'gpunb', 'api', endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  const text = await response.text();
  let data: { message?: string } | null = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    // Not JSON: a proxy's HTML error page, say. Report the HTTP status, not a SyntaxError.
    const start = text.slice(0, 200);
    throw new ServerConnection.ResponseError(
      response,
      `HTTP ${response.status} ${response.statusText} from ${url}, not JSON: ${start}`
    );
  }
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response, data?.message ?? text);
  }
  return data as unknown as T;
}
