import {
  Dialog,
  ReactWidget,
  showDialog,
  showErrorMessage
} from '@jupyterlab/apputils';
import { Message } from '@lumino/messaging';
import { Poll } from '@lumino/polling';
import * as React from 'react';

import { gpuKey, IDevices, IRun, IRunDetail, requestAPI } from './api';
import { Devices } from './gpus';
import { gpuIcon } from './icon';
import { Runs } from './runs';

const POLL_MS = 2000;
const HISTORY_MS = 60_000;

/**
 * The sidebar: polls the server every 2 s while it is visible and draws the GPUs
 * (with a 60 s utilisation history kept here) and the runs (with the loss
 * history of the running ones).
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
    const utilisation = new Map(
      [...this._utilisation].map(([key, samples]) => [
        key,
        samples.map(s => s.value)
      ])
    );
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
          <Devices devices={this._devices} history={utilisation} />
        ) : this._error ? null : (
          <div className="jp-gpunb-muted">Loading…</div>
        )}
        <Runs
          runs={this._runs}
          losses={this._losses}
          onStop={run => void this._stop(run)}
        />
      </div>
    );
  }

  private async _refresh(): Promise<void> {
    try {
      const [devices, { runs }] = await Promise.all([
        requestAPI<IDevices>('devices'),
        requestAPI<{ runs: IRun[] }>('runs')
      ]);
      this._devices = devices;
      this._runs = runs;
      this._recordUtilisation(devices);
      await this._fetchLosses(runs);
      this._error = null;
    } catch (error) {
      this._error = (error as Error).message;
      throw error; // lets the poll back off while the server is unreachable
    } finally {
      this.update();
    }
  }

  private _recordUtilisation(devices: IDevices): void {
    const now = Date.now();
    const seen = new Set<string>();
    for (const gpu of devices.gpus) {
      const key = gpuKey(gpu);
      seen.add(key);
      const samples = (this._utilisation.get(key) ?? []).filter(
        s => now - s.time <= HISTORY_MS
      );
      if (gpu.utilization_gpu !== undefined) {
        samples.push({ time: now, value: gpu.utilization_gpu });
      }
      this._utilisation.set(key, samples);
    }
    for (const key of [...this._utilisation.keys()]) {
      if (!seen.has(key)) {
        this._utilisation.delete(key);
      }
    }
  }

  /** Loss histories: fetched for running runs only; a finished run keeps its last one. */
  private async _fetchLosses(runs: IRun[]): Promise<void> {
    const running = runs.filter(run => run.status === 'running');
    const details = await Promise.allSettled(
      running.map(run => requestAPI<IRunDetail>(`runs/${run.id}`))
    );
    for (const detail of details) {
      if (detail.status === 'fulfilled') {
        const losses = detail.value.history
          .map(row => row.loss)
          .filter((loss): loss is number => typeof loss === 'number');
        this._losses.set(detail.value.id, losses);
      }
    }
    const listed = new Set(runs.map(run => run.id));
    for (const id of [...this._losses.keys()]) {
      if (!listed.has(id)) {
        this._losses.delete(id);
      }
    }
  }

  private async _stop(run: IRun): Promise<void> {
    const result = await showDialog({
      title: 'Stop training run?',
      body: `"${run.name}" stops cleanly at its next log interval and keeps the weights trained so far.`,
      buttons: [
        Dialog.cancelButton(),
        Dialog.warnButton({ label: 'Stop run' })
      ]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      await requestAPI(`runs/${run.id}/stop`, { method: 'POST' });
    } catch (error) {
      void showErrorMessage('Could not stop the run', error as Error);
    }
    void this._poll.refresh();
  }

  private _poll: Poll;
  private _devices: IDevices | null = null;
  private _runs: IRun[] = [];
  private _error: string | null = null;
  private _utilisation = new Map<string, { time: number; value: number }[]>();
  private _losses = new Map<string, number[]>();
}
