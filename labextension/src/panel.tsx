import {
  Dialog,
  ReactWidget,
  showDialog,
  showErrorMessage
} from '@jupyterlab/apputils';
import { Message } from '@lumino/messaging';
import { Poll } from '@lumino/polling';
import * as React from 'react';

import {
  gpuKey,
  IDevices,
  IRun,
  IRunDetail,
  ISweep,
  requestAPI
} from './api';
import { RunDetail } from './detail';
import { Devices, HOST_KEY } from './gpus';
import { gpuIcon } from './icon';
import { cancels, IRunActions, Runs } from './runs';

const POLL_MS = 2000;
const HISTORY_SAMPLES = 60; // kept per GPU and for the host CPU, like nvdashboard

/**
 * The sidebar: polls the server every 2 s while it is visible (one request for the
 * devices, one for the runs, which carries the running runs' losses) and draws the
 * GPUs and the host (with the last 60 samples kept here), the runs, and below them
 * the curves and configuration of the run opened.
 */
export class GpunbPanel extends ReactWidget {
  constructor() {
    super();
    this.id = 'gpunb-sidebar';
    this.title.icon = gpuIcon;
    this.title.caption = 'GPUs and training runs';
    this.addClass('jp-gpunb-panel');
    this._poll = new Poll({
      factory: () => this._refresh(),
      frequency: { interval: POLL_MS, backoff: true, max: 30_000 },
      name: 'gpunb:sidebar',
      // Skip ticks while the panel is collapsed or the browser tab is hidden.
      standby: () => this.isHidden || 'when-hidden'
    });
  }

  dispose(): void {
    this._poll.dispose();
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._poll.refresh();
  }

  protected render(): JSX.Element {
    return (
      <div className="jp-gpunb-body">
        {this._error ? (
          <div className="jp-gpunb-error">
            Cannot reach the gpunb server extension ({this._error}). Check
            that <code>jupyter server extension list</code> shows gpunb
            enabled, then restart Jupyter.
          </div>
        ) : null}
        {this._devices ? (
          <Devices devices={this._devices} history={this._history} />
        ) : this._error ? null : (
          <div className="jp-gpunb-muted">Loading…</div>
        )}
        {/* The list stays while a run is open: a new run and its Stop button are never hidden. */}
        <Runs
          runs={this._runs}
          sweeps={this._sweeps}
          losses={this._losses}
          error={this._runsError}
          actions={this._actions}
          openId={this._detail?.id ?? null}
        />
        {this._detail ? (
          <RunDetail
            run={this._detail}
            actions={this._actions}
            onClose={() => this._close()}
          />
        ) : null}
      </div>
    );
  }

  private async _refresh(): Promise<void> {
    const [devices, runs] = await Promise.allSettled([
      requestAPI<IDevices>('devices'),
      requestAPI<{ runs: IRun[]; sweeps?: ISweep[] }>('runs')
    ]);
    if (devices.status === 'fulfilled') {
      this._devices = devices.value;
      this._record(devices.value);
      this._error = null;
    } else {
      this._error = (devices.reason as Error).message;
    }
    if (runs.status === 'fulfilled') {
      this._runs = runs.value.runs;
      this._sweeps = runs.value.sweeps ?? [];
      this._recordLosses(this._runs);
      this._runsError = null;
    } else {
      // The server's message: e.g. which registry file is locked or damaged, and what to do.
      this._runsError = (runs.reason as Error).message;
    }
    const open = this._runs.find(run => run.id === this._detail?.id);
    if (open?.status === 'running' || open?.status !== this._detail?.status) {
      await this._load(open ?? null);
    }
    this.update();
    if (devices.status === 'rejected') {
      throw devices.reason; // lets the poll back off while the server is unreachable
    }
  }

  private _record(devices: IDevices): void {
    const samples = new Map<string, number | undefined>(
      devices.gpus.map(gpu => [gpuKey(gpu), gpu.utilization_gpu])
    );
    samples.set(HOST_KEY, devices.host.cpu_percent);
    for (const key of [...this._history.keys()]) {
      if (!samples.has(key)) {
        this._history.delete(key); // a GPU that went away
      }
    }
    for (const [key, value] of samples) {
      const history = this._history.get(key) ?? [];
      if (value !== undefined && value !== null) {
        history.push(value);
      }
      this._history.set(key, history.slice(-HISTORY_SAMPLES));
    }
  }

  /** Running runs bring their newest losses; a finished run keeps the last ones seen. */
  private _recordLosses(runs: IRun[]): void {
    for (const run of runs) {
      if (run.losses) {
        this._losses.set(
          run.id,
          run.losses.map(([, loss]) => loss)
        );
      }
    }
    const listed = new Set(runs.map(run => run.id));
    for (const id of [...this._losses.keys()]) {
      if (!listed.has(id)) {
        this._losses.delete(id);
      }
    }
  }

  /** Fetch one run's full history for the detail view (null closes it). */
  private async _load(run: IRun | null): Promise<void> {
    if (run === null) {
      this._detail = null;
      return;
    }
    try {
      this._detail = await requestAPI<IRunDetail>(`runs/${run.id}`);
    } catch (error) {
      this._detail = null;
      this._runsError = (error as Error).message;
    }
  }

  private async _open(run: IRun): Promise<void> {
    await this._load(run);
    this.update();
  }

  private _close(): void {
    this._detail = null;
    this.update();
  }

  private async _stop(run: IRun): Promise<void> {
    const cancel = cancels(run);
    const result = await showDialog(
      cancel
        ? {
            title: 'Cancel job?',
            body:
              run.status === 'queued'
                ? `"${run.name}" leaves the queue: it has not started, nothing is lost.`
                : `"${run.name}" ends now instead of at its next step: its newest checkpoint stays, the steps since it are lost.`,
            buttons: [
              Dialog.cancelButton({ label: 'Keep it' }),
              Dialog.warnButton({ label: 'Cancel job' })
            ]
          }
        : {
            title: 'Stop training run?',
            body: `"${run.name}" stops cleanly at its next log interval and keeps the weights trained so far.`,
            buttons: [
              Dialog.cancelButton(),
              Dialog.warnButton({ label: 'Stop run' })
            ]
          }
    );
    if (!result.button.accept) {
      return;
    }
    try {
      // The server decides again from the registry: a job asked to stop meanwhile is cancelled.
      await requestAPI(`runs/${run.id}/stop`, { method: 'POST' });
    } catch (error) {
      void showErrorMessage(
        cancel ? 'Could not cancel the job' : 'Could not stop the run',
        error as Error
      );
    }
    void this._poll.refresh();
  }

  private async _stopSweep(sweep: ISweep): Promise<void> {
    const result = await showDialog({
      title: 'Stop sweep?',
      body: `"${sweep.name}" asks no more trials; its running trials stop cleanly at their next step and keep their checkpoints.`,
      buttons: [
        Dialog.cancelButton(),
        Dialog.warnButton({ label: 'Stop sweep' })
      ]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      await requestAPI(`sweeps/${encodeURIComponent(sweep.name)}/stop`, {
        method: 'POST'
      });
    } catch (error) {
      void showErrorMessage('Could not stop the sweep', error as Error);
    }
    void this._poll.refresh();
  }

  private async _remove(run: IRun): Promise<void> {
    const result = await showDialog({
      title: 'Remove run?',
      body: `"${run.name}" and its metrics are deleted from the run registry. Checkpoints on disk stay.`,
      buttons: [
        Dialog.cancelButton(),
        Dialog.warnButton({ label: 'Remove run' })
      ]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      await requestAPI(`runs/${run.id}`, { method: 'DELETE' });
      this._runs = this._runs.filter(other => other.id !== run.id);
      if (this._detail?.id === run.id) {
        this._detail = null;
      }
      this.update();
    } catch (error) {
      void showErrorMessage('Could not remove the run', error as Error);
    }
    void this._poll.refresh();
  }

  private _poll: Poll;
  private _devices: IDevices | null = null;
  private _runs: IRun[] = [];
  private _sweeps: ISweep[] = [];
  private _detail: IRunDetail | null = null;
  private _error: string | null = null;
  private _runsError: string | null = null;
  private _history = new Map<string, number[]>();
  private _losses = new Map<string, number[]>();
  private _actions: IRunActions = {
    onStop: run => void this._stop(run),
    onRemove: run => void this._remove(run),
    onOpen: run => void this._open(run),
    onStopSweep: sweep => void this._stopSweep(sweep)
  };
}
