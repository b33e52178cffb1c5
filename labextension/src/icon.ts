import { LabIcon } from '@jupyterlab/ui-components';

import gpuSvgstr from '../style/icons/gpu.svg';

export const gpuIcon = new LabIcon({ name: 'gpunb:gpu', svgstr: gpuSvgstr });
