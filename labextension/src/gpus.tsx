import * as React from 'react';

import { gpuKey, IDevices, IGpu, IHost } from './api';
import { Bar, Sparkline } from './charts';
import { basename, gib, number } from './format';

function GpuCard(props: { gpu: IGpu; history: number[] }): JSX.Element {
  const { gpu } = props;
  const memoryPercent =
    gpu.memory_used_mb !== undefined && gpu.memory_total_mb
      ? (100 * gpu.memory_used_mb) / gpu.memory_total_mb
      : undefined;
  const power =
    gpu.power_w === undefined
      ? null
      : `${number(gpu.power_w)}${gpu.power_limit_w ? ` / ${number(gpu.power_limit_w)}` : ''} W`;
  const temperature =
    gpu.temperature_c === undefined ? null : `${gpu.temperature_c} °C`;
  return (
    <div className="jp-gpunb-card" data-gpu={gpuKey(gpu)}>
      <div className="jp-gpunb-card-title">
        <span className="jp-gpunb-ellipsis" title={gpu.name}>
          GPU {gpu.index} · {gpu.name ?? 'unknown model'}
        </span>
      </div>
      <div className="jp-gpunb-muted">
        {[power, temperature].filter(Boolean).join(' · ')}
      </div>
      <Bar
        label="Utilisation"
        percent={gpu.utilization_gpu}
        detail={`${number(gpu.utilization_gpu)} %`}
      />
      <Bar
        label="Memory"
        percent={memoryPercent}
        detail={`${gib(gpu.memory_used_mb)} / ${gib(gpu.memory_total_mb)} GiB`}
      />
      <Sparkline
        values={props.history}
        max={100}
        title="GPU utilisation, last 60 samples"
      />
      <ProcessList gpu={gpu} />
    </div>
  );
}

function ProcessList(props: { gpu: IGpu }): JSX.Element {
  const processes = props.gpu.processes ?? [];
  if (processes.length === 0) {
    return <div className="jp-gpunb-muted">No processes</div>;
  }
  return (
    <ul className="jp-gpunb-processes">
      {processes.map(p => (
        <li key={p.pid} title={p.notebook ?? `process ${p.pid}`}>
          <span>{p.notebook ? basename(p.notebook) : `pid ${p.pid}`}</span>
          <span className="jp-gpunb-muted">{gib(p.used_memory_mb)} GiB</span>
        </li>
      ))}
    </ul>
  );
}

/** The history key of the host's CPU utilisation (GPUs are keyed by `gpuKey`). */
export const HOST_KEY = 'host-cpu';

export function HostStats(props: { host: IHost; history: number[] }): JSX.Element {
  const { host } = props;
  return (
    <div className="jp-gpunb-card jp-gpunb-host">
      <div className="jp-gpunb-card-title">
        <span>Host</span>
        <span className="jp-gpunb-muted">
          {host.cpu_count ? `${host.cpu_count} CPUs` : ''}
        </span>
      </div>
      <Bar
        label="CPU"
        percent={host.cpu_percent}
        detail={`${number(host.cpu_percent)} %`}
      />
      <Bar
        label="RAM"
        percent={host.ram_percent}
        detail={`${gib(host.ram_used_mb)} / ${gib(host.ram_total_mb)} GiB`}
      />
      <Sparkline
        values={props.history}
        max={100}
        title="CPU utilisation, last 60 samples"
      />
    </div>
  );
}

/** GPU cards, or the no-GPU state, then the host's CPU and RAM. */
export function Devices(props: {
  devices: IDevices;
  history: Map<string, number[]>;
}): JSX.Element {
  const { devices } = props;
  return (
    <section className="jp-gpunb-section">
      <h3 className="jp-gpunb-heading">
        GPUs
        {devices.driver ? (
          <span className="jp-gpunb-muted jp-gpunb-driver">
            {' '}
            · driver {devices.driver}
          </span>
        ) : null}
      </h3>
      {devices.nvidia && devices.gpus.length > 0 ? (
        devices.gpus.map(gpu => (
          <GpuCard
            key={gpuKey(gpu)}
            gpu={gpu}
            history={props.history.get(gpuKey(gpu)) ?? []}
          />
        ))
      ) : (
        <div className="jp-gpunb-card jp-gpunb-nogpu">
          <div className="jp-gpunb-card-title">CPU only</div>
          <div className="jp-gpunb-muted">
            {devices.reason ?? 'No NVIDIA GPU was found on this machine.'}{' '}
            Training runs on the CPU here.
          </div>
        </div>
      )}
      <HostStats
        host={devices.host}
        history={props.history.get(HOST_KEY) ?? []}
      />
    </section>
  );
}
