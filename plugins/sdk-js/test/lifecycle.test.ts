// What contract 0.2.0 added to the SDK, in Node: related objects (customize and the
// Context accessors), teardown waves, admission validation and conversion, with their
// defaults and their refusals.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import {
  Desired,
  definePlugin,
  Finalized,
  Invalid,
  Kinds,
  type KubeObject,
  namespacedKind,
  pluginInfo,
  Related,
  Retry,
} from '../src/index.js';
import { bindPlugin } from '../src/binding.js';
import {
  captureLogs,
  observeFor,
  render,
  renderConvert,
  renderCustomize,
  renderFinalize,
  renderValidate,
} from '../src/testing.js';

interface CacheSpec {
  mode?: string;
  config?: string;
  replicas?: number;
  size?: number;
}

const cacheKind = namespacedKind('example.com', 'v2', 'Cache', 'caches');

/**
 * A Cache (example.com/v2, served as v1 too) with a StatefulSet and a Service, that reads
 * a ConfigMap, its Pods and its Namespace; the spec's `mode` makes each hook misbehave on
 * purpose.
 */
const keeper = definePlugin<CacheSpec, Record<string, unknown>>({
  describe: () => ({
    name: 'keeper',
    version: '0.0.1',
    parent: cacheKind,
    children: [Kinds.StatefulSet, Kinds.Service],
    finalizer: true,
    related: [Kinds.ConfigMap, Kinds.Pod, Kinds.Namespace],
    validation: 'fail',
    conversion: true,
  }),

  customize(ctx) {
    const { mode, config = 'default' } = ctx.spec();
    if (mode === 'undeclared') {
      return [Related.named(Kinds.Secret, 'creds')];
    }
    if (mode === 'bug') {
      return (null as unknown as { boom(): Related[] }).boom();
    }
    if (mode === 'not-related') {
      return [{ kind: Kinds.ConfigMap, selector: { name: 'x' } } as unknown as Related];
    }
    return [
      Related.named(Kinds.ConfigMap, config),
      Related.labelled(Kinds.Pod, { app: ctx.name }),
      Related.named(Kinds.Namespace, ctx.namespace),
    ];
  },

  reconcile(ctx) {
    const config = ctx.relatedNamed(Kinds.ConfigMap, ctx.spec().config ?? 'default');
    return new Desired().status({
      config: config?.data ?? null,
      pods: ctx
        .related(Kinds.Pod)
        .map((p) => p.metadata.name)
        .sort(),
      namespace: ctx.related(Kinds.Namespace)[0]?.metadata.name ?? null,
    });
  },

  finalize(ctx) {
    const { mode } = ctx.spec();
    if (mode === 'undeclared') {
      return Finalized.wave().delete(Kinds.ConfigMap, 'settings');
    }
    if (mode === 'bug') {
      throw new RangeError('no more waves');
    }
    // The StatefulSet goes first, so that its Pods stop before the Service goes.
    if (ctx.child(Kinds.StatefulSet, ctx.name)) {
      return Finalized.wave().delete(Kinds.StatefulSet, ctx.name).event('Stopping', 'the StatefulSet goes first');
    }
    if (ctx.child(Kinds.Service, ctx.name)) {
      return Finalized.wave().delete(Kinds.Service, ctx.name);
    }
    return Finalized.done();
  },

  validate(old, object) {
    const spec = object.spec ?? {};
    switch (spec.mode) {
      case 'bug':
        return (null as unknown as { boom(): string[] }).boom();
      case 'multi-line':
        throw new Error('first line\n  second line\n');
      case 'retry':
        throw new Retry('try again');
      case 'not-a-list':
        return 'fine' as unknown as string[];
      case 'nothing':
        return;
    }
    if ((spec.replicas ?? 1) < 0) {
      throw new Invalid('spec.replicas must not be negative');
    }
    if (old !== undefined && (old.spec?.replicas ?? 1) > (spec.replicas ?? 1)) {
      return [`scaling ${object.metadata.name} down`];
    }
    return [];
  },

  convert(object, toVersion) {
    const spec = { ...(object.spec ?? {}) } as CacheSpec;
    if (spec.mode === 'bug') {
      throw new TypeError('cannot read the spec');
    }
    if (spec.mode === 'not-an-object') {
      return [object] as unknown as KubeObject;
    }
    if (toVersion === 'v1') {
      if (spec.replicas !== undefined) {
        spec.size = spec.replicas;
        delete spec.replicas;
      }
    } else if (toVersion === 'v2') {
      if (spec.size !== undefined) {
        spec.replicas = spec.size;
        delete spec.size;
      }
    } else {
      throw new Invalid(`Cache has no version ${toVersion}`);
    }
    return { ...object, apiVersion: `example.com/${toVersion}`, spec: spec as Record<string, unknown> };
  },
});

/** Only describe and reconcile: every 0.2.0 hook takes its default. */
const minimal = definePlugin({
  describe: () => ({ name: 'minimal', version: '0.0.1', parent: cacheKind, children: [Kinds.Service], finalizer: true }),
  reconcile: () => new Desired(),
});

function cache(spec: CacheSpec = {}, apiVersion = 'example.com/v2'): KubeObject {
  return {
    apiVersion,
    kind: 'Cache',
    metadata: { name: 'c', namespace: 'team', uid: 'uid-c', generation: 1 },
    spec: spec as Record<string, unknown>,
  };
}

function object(apiVersion: string, kind: string, name: string, fields: Record<string, unknown> = {}): KubeObject {
  return { apiVersion, kind, metadata: { name }, ...fields };
}

/** Runs `call` with log lines captured at error level; returns them. */
function errorLines(call: () => void): string[] {
  const logs = captureLogs('error');
  try {
    call();
  } finally {
    logs.restore();
  }
  return logs.lines.map((l) => l.message);
}

describe('the declaration', () => {
  test('defaults declare no related kinds, no validation, no conversion', () => {
    const info = pluginInfo(minimal.describe());
    assert.deepEqual([info.related, info.validation, info.conversion], [[], undefined, false]);
  });

  test('carries related kinds, the failure policy and conversion', () => {
    const info = bindPlugin(keeper).describe();
    assert.deepEqual(
      info.related.map((k) => [k.kind, k.namespaced]),
      [
        ['ConfigMap', true],
        ['Pod', true],
        ['Namespace', false],
      ],
    );
    assert.equal(info.validation, 'fail');
    assert.equal(info.conversion, true);
  });

  test('refuses a failure policy the contract does not have', () => {
    assert.throws(
      () => pluginInfo({ name: 'n', version: '1', parent: cacheKind, validation: 'Fail' as 'fail' }),
      { name: 'TypeError', message: `validation is "Fail", not 'fail' or 'ignore'` },
    );
  });
});

describe('Related', () => {
  test('by name and by labels, from a record or pairs', () => {
    assert.deepEqual(Related.named(Kinds.ConfigMap, 'a').selector, { name: 'a' });
    const byRecord = Related.labelled(Kinds.Pod, { app: 'x', tier: 'db' });
    assert.deepEqual(byRecord.selector, {
      labels: [
        ['app', 'x'],
        ['tier', 'db'],
      ],
    });
    assert.deepEqual(
      Related.labelled(Kinds.Pod, [
        ['app', 'x'],
        ['tier', 'db'],
      ]),
      byRecord,
    );
    assert.deepEqual(Related.labelled(Kinds.Pod, {}).selector, { labels: [] });
  });

  test('wrong arguments are type errors', () => {
    assert.throws(() => Related.named(Kinds.ConfigMap, ''), { name: 'TypeError', message: /non-empty name/ });
    assert.throws(() => Related.labelled(Kinds.Pod, { app: 1 as unknown as string }), {
      name: 'TypeError',
      message: /string label keys and values/,
    });
  });
});

describe('Context', () => {
  test('gives the related objects of one declared kind, and by name', () => {
    const settings = object('v1', 'ConfigMap', 'settings');
    const pods = [object('v1', 'Pod', 'c-0'), object('v1', 'Pod', 'c-1')];
    const secret = object('v1', 'Secret', 's');
    const ctx = observeFor(keeper, cache(), [], [settings, ...pods, secret]);
    assert.deepEqual(ctx.related(Kinds.Pod), pods);
    assert.equal(ctx.relatedNamed(Kinds.ConfigMap, 'settings'), settings);
    assert.equal(ctx.relatedNamed(Kinds.ConfigMap, 'other'), undefined);
    assert.deepEqual(ctx.related(Kinds.Namespace), []);
    assert.equal(ctx.allRelated().length, 3, 'the undeclared Secret is dropped');
    assert.deepEqual(ctx.allChildren(), []);
  });
});

describe('customize', () => {
  test('asks by name and by labels, by kind index on the wire', () => {
    assert.deepEqual(bindPlugin(keeper).customize(JSON.stringify(cache({ config: 'settings' }))), [
      { kindIndex: 0, selector: { tag: 'name', val: 'settings' } },
      { kindIndex: 1, selector: { tag: 'labels', val: [['app', 'c']] } },
      { kindIndex: 2, selector: { tag: 'name', val: 'team' } },
    ]);
    assert.deepEqual(renderCustomize(keeper, cache({ config: 'settings' })), {
      ok: true,
      requests: [
        Related.named(Kinds.ConfigMap, 'settings'),
        Related.labelled(Kinds.Pod, { app: 'c' }),
        Related.named(Kinds.Namespace, 'team'),
      ],
    });
  });

  test('defaults to no requests', () => {
    assert.deepEqual(renderCustomize(minimal, cache()), { ok: true, requests: [] });
  });

  test('an undeclared kind is invalid, naming it', () => {
    assert.deepEqual(renderCustomize(keeper, cache({ mode: 'undeclared' })), {
      ok: false,
      error: { tag: 'invalid', val: 'customize asks for Secret (v1), which the plugin does not declare as related' },
    });
  });

  test('a bug is a retry naming it, its stack logged', () => {
    let out: ReturnType<typeof renderCustomize> | undefined;
    const lines = errorLines(() => (out = renderCustomize(keeper, cache({ mode: 'bug' }))));
    assert.ok(out !== undefined && !out.ok);
    assert.equal(out.error.tag, 'retry');
    assert.match(out.error.val, /^TypeError: /);
    assert.equal(lines.length, 1);
    assert.match(lines[0] ?? '', /^customize threw TypeError/);
  });

  test('anything but a Related is a retry', () => {
    assert.deepEqual(renderCustomize(keeper, cache({ mode: 'not-related' })), {
      ok: false,
      error: { tag: 'retry', val: 'customize returned object in its array, not a Related' },
    });
  });
});

describe('reconcile with related objects', () => {
  test('sees the related objects the host passes', () => {
    const related = [
      object('v1', 'ConfigMap', 'settings', { data: { size: '3' } }),
      object('v1', 'Pod', 'c-1'),
      object('v1', 'Pod', 'c-0'),
      object('v1', 'Namespace', 'team'),
    ];
    const out = render(keeper, cache({ config: 'settings' }), [], related);
    assert.ok(out.ok);
    assert.deepEqual(out.desired.status, { config: { size: '3' }, pods: ['c-0', 'c-1'], namespace: 'team' });
  });

  test('sees none when none are passed', () => {
    const out = render(keeper, cache());
    assert.ok(out.ok);
    assert.deepEqual(out.desired.status, { config: null, pods: [], namespace: null });
  });
});

describe('teardown waves', () => {
  const statefulSet = object('apps/v1', 'StatefulSet', 'c');
  const service = object('v1', 'Service', 'c');

  test('wave after wave, then done', () => {
    assert.deepEqual(renderFinalize(keeper, cache(), [statefulSet, service]), {
      ok: true,
      result: {
        done: false,
        events: [{ type: 'normal', reason: 'Stopping', message: 'the StatefulSet goes first' }],
        requeueAfterSeconds: undefined,
        delete: [{ kind: Kinds.StatefulSet, name: 'c' }],
      },
    });
    const second = renderFinalize(keeper, cache(), [service]);
    assert.ok(second.ok);
    assert.deepEqual(second.result.delete, [{ kind: Kinds.Service, name: 'c' }]);
    const last = renderFinalize(keeper, cache(), []);
    assert.ok(last.ok);
    assert.deepEqual([last.result.done, last.result.delete], [true, []]);
  });

  test('the wire carries kind indexes', () => {
    const info = pluginInfo(keeper.describe());
    const wave = Finalized.wave().delete(Kinds.Service, 'a').delete(Kinds.StatefulSet, 'b');
    assert.equal(wave.isDone, false);
    assert.deepEqual(wave.toWit(info).delete, [
      { kindIndex: 1, name: 'a' },
      { kindIndex: 0, name: 'b' },
    ]);
  });

  test('defaults to done', () => {
    assert.deepEqual(renderFinalize(minimal, cache(), [service]), {
      ok: true,
      result: { done: true, events: [], requeueAfterSeconds: undefined, delete: [] },
    });
  });

  test('a wave naming an undeclared kind is invalid, naming it', () => {
    assert.deepEqual(renderFinalize(keeper, cache({ mode: 'undeclared' })), {
      ok: false,
      error: { tag: 'invalid', val: 'finalize names ConfigMap "settings" (v1), not a declared child kind' },
    });
  });

  test('a bug is a retry naming it', () => {
    let out: ReturnType<typeof renderFinalize> | undefined;
    const lines = errorLines(() => (out = renderFinalize(keeper, cache({ mode: 'bug' }))));
    assert.deepEqual(out, { ok: false, error: { tag: 'retry', val: 'RangeError: no more waves' } });
    assert.match(lines[0] ?? '', /^finalize threw RangeError/);
  });

  test('a child to delete needs a name', () => {
    assert.throws(() => Finalized.wave().delete(Kinds.Service, ''), { name: 'TypeError', message: /non-empty name/ });
  });
});

describe('validate', () => {
  test('allows, with warnings', () => {
    assert.deepEqual(renderValidate(keeper, undefined, cache({ replicas: 3 })), { ok: true, warnings: [] });
    assert.deepEqual(renderValidate(keeper, cache({ replicas: 3 }), cache({ replicas: 1 })), {
      ok: true,
      warnings: ['scaling c down'],
    });
    assert.deepEqual(renderValidate(keeper, undefined, cache({ mode: 'nothing' })), { ok: true, warnings: [] });
  });

  test("refuses with the plugin's message", () => {
    assert.deepEqual(renderValidate(keeper, undefined, cache({ replicas: -1 })), {
      ok: false,
      refusal: 'spec.replicas must not be negative',
    });
    assert.deepEqual(renderValidate(keeper, undefined, cache({ mode: 'retry' })), { ok: false, refusal: 'try again' });
  });

  test('defaults to allowing everything', () => {
    assert.deepEqual(renderValidate(minimal, undefined, cache({ replicas: -1 })), { ok: true, warnings: [] });
    assert.deepEqual(bindPlugin(minimal).validate(JSON.stringify(cache()), JSON.stringify(cache({ size: 9 }))), []);
  });

  test('a bug is a one-line refusal without the stack, which goes to the log', () => {
    let out: ReturnType<typeof renderValidate> | undefined;
    const lines = errorLines(() => (out = renderValidate(keeper, undefined, cache({ mode: 'bug' }))));
    assert.ok(out !== undefined && !out.ok);
    assert.match(out.refusal, /^TypeError: [^\n]+$/);
    assert.doesNotMatch(out.refusal, /\bat /);
    assert.match(lines[0] ?? '', /^validate threw TypeError[^]*\bat /);
    errorLines(() => (out = renderValidate(keeper, undefined, cache({ mode: 'multi-line' }))));
    assert.deepEqual(out, { ok: false, refusal: 'Error: first line second line' });
  });

  test('anything but an array of strings is a refusal', () => {
    assert.deepEqual(renderValidate(keeper, undefined, cache({ mode: 'not-a-list' })), {
      ok: false,
      refusal: 'validate returned "fine", not an array of warning strings',
    });
  });

  test('an object that is not JSON is a refusal saying so', () => {
    assert.throws(
      () => bindPlugin(keeper).validate(undefined, '{not json'),
      (e: unknown) => typeof (e as { payload?: unknown }).payload === 'string' &&
        (e as { payload: string }).payload.startsWith('host sent an object that is not JSON'),
    );
  });
});

describe('convert', () => {
  test('both ways', () => {
    const v1 = cache({ size: 3 }, 'example.com/v1');
    const v2 = renderConvert(keeper, v1, 'v2');
    assert.ok(v2.ok);
    assert.deepEqual([v2.object.apiVersion, v2.object.spec], ['example.com/v2', { replicas: 3 }]);
    assert.deepEqual(renderConvert(keeper, v2.object, 'v1'), { ok: true, object: v1 });
  });

  test("refuses with the plugin's message", () => {
    assert.deepEqual(renderConvert(keeper, cache(), 'v3'), { ok: false, refusal: 'Cache has no version v3' });
  });

  test('defaults to refusing', () => {
    assert.deepEqual(renderConvert(minimal, cache(), 'v1'), {
      ok: false,
      refusal: 'this plugin does not convert (asked for v1)',
    });
  });

  test('a bug is a one-line refusal without the stack', () => {
    let out: ReturnType<typeof renderConvert> | undefined;
    const lines = errorLines(() => (out = renderConvert(keeper, cache({ mode: 'bug' }), 'v1')));
    assert.deepEqual(out, { ok: false, refusal: 'TypeError: cannot read the spec' });
    assert.match(lines[0] ?? '', /^convert threw TypeError: cannot read the spec/);
  });

  test('anything but an object is a refusal', () => {
    assert.deepEqual(renderConvert(keeper, cache({ mode: 'not-an-object' }), 'v1'), {
      ok: false,
      refusal: 'convert returned an array, not an object',
    });
  });
});
