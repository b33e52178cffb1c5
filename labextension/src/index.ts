import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';

import { GpunbPanel } from './panel';

/** The gpunb sidebar: GPUs of this server and every training run, in the left area. */
const plugin: JupyterFrontEndPlugin<void> = {
  id: 'gpunb:sidebar',
  description: 'GPUs and gpunb training runs of this Jupyter server.',
  autoStart: true,
  optional: [ILayoutRestorer],
  activate: (app: JupyterFrontEnd, restorer: ILayoutRestorer | null) => {
    const panel = new GpunbPanel();
    app.shell.add(panel, 'left', { rank: 900 });
    restorer?.add(panel, panel.id);
  }
};

export default plugin;
