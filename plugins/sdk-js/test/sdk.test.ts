// The SDK in Node: contexts, the Desired builder, errors as the contract's variant, logs.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import { Context, Desired, Finalized, Invalid, Kinds, type KubeObject, log, namespacedKind, Retry } from '../src/index.js';
import { bindPlugin } from '../src/binding.js';
import { definePlugin, pluginInfo } from '../src/plugin.js';
import { decodeMappings, SourcePositions } from '../src/sourcemap.js';
import { captureLogs, observeFor, render } from '../src/testing.js';

interface WidgetSpec {
  size?: number;
}

const widget = namespacedKind('test.capstan.dev', 'v1', 'Widget', 'widgets');

const plugin = definePlugin<WidgetSpec, { made: number }>({
  describe: () => ({ name: 'widget', version: '0.1.0', parent: widget, children: [Kinds.ConfigMap, Kinds.Secret] }),
  reconcile(ctx) {
    const size = ctx.spec().size;
    if (size === undefined) {
      throw new Invalid('spec.size is required');
    }
    if (size < 0) {
      throw new Retry('negative sizes are not supported yet');
    }
    if (size > 100) {
      (null as unknown as { boom(): void }).boom();
    }
    log.info(`sizing ${ctx.name}`);
    return new Desired()
      .child({ apiVersion: 'v1', kind: 'ConfigMap', metadata: { name: `${ctx.name}-size` }, data: { size: String(size) } })
      .status({ made: ctx.children(Kinds.ConfigMap).length })
      .condition('Sized', true, 'Sized', `size ${size}`)
      .event('Sized', 'sized it')
      .requeueAfter(59.2);
  },
});

function parent(spec: WidgetSpec): KubeObject {
  return {
    apiVersion: 'test.capstan.dev/v1',
    kind: 'Widget',
    metadata: { name: 'w', namespace: 'team-a', uid: 'uid-1', generation: 3 },
    spec: spec as Record<string, unknown>,
  };
}

const configMap = (name: string): KubeObject => ({ apiVersion: 'v1', kind: 'ConfigMap', metadata: { name } });

describe('Context', () => {
  test('reads the parent metadata', () => {
    const ctx = observeFor(plugin, parent({ size: 1 }));
    assert.equal(ctx.name, 'w');
    assert.equal(ctx.namespace, 'team-a');
    assert.equal(ctx.uid, 'uid-1');
    assert.equal(ctx.generation, 3);
    assert.equal(ctx.isDeleting, false);
    assert.deepEqual(ctx.spec(), { size: 1 });
    assert.equal(ctx.status(), undefined);
  });

  test('gives the children of one declared kind, and drops undeclared ones', () => {
    const service: KubeObject = { apiVersion: 'v1', kind: 'Service', metadata: { name: 's' } };
    const secret: KubeObject = { apiVersion: 'v1', kind: 'Secret', metadata: { name: 'x' } };
    const ctx = observeFor(plugin, parent({}), [configMap('a'), service, secret, configMap('b')]);
    assert.deepEqual(
      ctx.children(Kinds.ConfigMap).map((c) => c.metadata.name),
      ['a', 'b'],
    );
    assert.equal(ctx.child(Kinds.Secret, 'x')?.kind, 'Secret');
    assert.equal(ctx.child(Kinds.Secret, 'y'), undefined);
    assert.equal(ctx.allChildren().length, 3);
  });

  test('turns a parse failure of the spec into Invalid', () => {
    const ctx = new Context(pluginInfo(plugin.describe()), parent({ size: 1 }), []);
    assert.throws(
      () =>
        ctx.spec((raw) => {
          throw new TypeError(`size must be a string, got ${JSON.stringify(raw)}`);
        }),
      (e: unknown) => e instanceof Invalid && e.message === 'spec: size must be a string, got {"size":1}',
    );
  });
});

describe('Desired', () => {
  test('encodes every object as JSON text, with the contract enums', () => {
    const wit = new Desired()
      .child({ apiVersion: 'v1', kind: 'ConfigMap', metadata: { name: 'c' } })
      .status({ phase: 'Ready' })
      .condition('Backup', 'unknown', 'Pending', 'not yet')
      .warning('Slow', 'took long')
      .toWit();
    assert.deepEqual(wit, {
      children: ['{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"c"}}'],
      status: '{"phase":"Ready"}',
      conditions: [{ type: 'Backup', status: 'unknown', reason: 'Pending', message: 'not yet' }],
      events: [{ type: 'warning', reason: 'Slow', message: 'took long' }],
      requeueAfterSeconds: undefined,
    });
  });

  test('rounds the requeue delay up to whole seconds, at least one', () => {
    assert.equal(new Desired().requeueAfter(0).requeueAfterSeconds, 1);
    assert.equal(new Desired().requeueAfter(1.5).requeueAfterSeconds, 2);
    assert.equal(new Desired().requeueAfter(Infinity).requeueAfterSeconds, 0xffffffff);
  });

  test('finalize results say whether cleanup is done', () => {
    const info = pluginInfo(plugin.describe());
    assert.deepEqual(Finalized.done().toWit(info), { done: true, events: [], requeueAfterSeconds: undefined, delete: [] });
    assert.deepEqual(Finalized.pending(10).event('Draining', 'wait').toWit(info), {
      done: false,
      events: [{ type: 'normal', reason: 'Draining', message: 'wait' }],
      requeueAfterSeconds: 10,
      delete: [],
    });
  });
});

describe('the contract binding', () => {
  test('fills the declaration defaults', () => {
    const info = pluginInfo({ name: 'n', version: '1', parent: widget, crd: { kind: 'CustomResourceDefinition' } });
    assert.deepEqual(info, {
      name: 'n',
      version: '1',
      parent: widget,
      children: [],
      finalizer: false,
      resyncSeconds: undefined,
      crd: '{"kind":"CustomResourceDefinition"}',
      related: [],
      validation: undefined,
      conversion: false,
    });
  });

  test('returns the desired state as the host receives it', () => {
    const out = render(plugin, parent({ size: 2 }), [configMap('w-size')]);
    assert.ok(out.ok);
    assert.deepEqual(out.desired.children, [
      { apiVersion: 'v1', kind: 'ConfigMap', metadata: { name: 'w-size' }, data: { size: '2' } },
    ]);
    assert.deepEqual(out.desired.status, { made: 1 });
    assert.deepEqual(out.desired.conditions, [{ type: 'Sized', status: 'true', reason: 'Sized', message: 'size 2' }]);
    assert.deepEqual(out.desired.events, [{ type: 'normal', reason: 'Sized', message: 'sized it' }]);
    assert.equal(out.desired.requeueAfterSeconds, 60);
  });

  test('maps Invalid and Retry to their cases of the error variant', () => {
    assert.deepEqual(render(plugin, parent({})), { ok: false, error: { tag: 'invalid', val: 'spec.size is required' } });
    assert.deepEqual(render(plugin, parent({ size: -1 })), {
      ok: false,
      error: { tag: 'retry', val: 'negative sizes are not supported yet' },
    });
  });

  test('reports any other exception as retry with its message, and logs its stack', () => {
    const logs = captureLogs('error');
    try {
      const out = render(plugin, parent({ size: 101 }));
      assert.ok(!out.ok);
      assert.equal(out.error.tag, 'retry');
      assert.match(out.error.val, /^TypeError: /);
      assert.equal(logs.lines.length, 1);
      assert.match(logs.lines[0]?.message ?? '', /^reconcile threw TypeError/);
    } finally {
      logs.restore();
    }
  });

  test('defaults finalize to done', () => {
    const observed = { parent: JSON.stringify(parent({})), children: [], related: [] };
    assert.deepEqual(bindPlugin(plugin).finalize(observed), {
      done: true,
      events: [],
      requeueAfterSeconds: undefined,
      delete: [],
    });
  });
});

describe('log', () => {
  test('builds lazy messages only when their level is enabled', () => {
    const logs = captureLogs('info');
    try {
      let built = 0;
      log.debug(() => `${++built}`);
      log.info(() => `built ${++built}`);
      log.warn('plain');
      assert.equal(built, 1);
      assert.deepEqual(logs.lines, [
        { level: 'info', message: 'built 1' },
        { level: 'warn', message: 'plain' },
      ]);
      assert.equal(log.enabled('debug'), false);
    } finally {
      logs.restore();
    }
  });
});

describe('source maps', () => {
  // A map esbuild wrote for a two-line source (`const a = 1;\nthrow new Error(a);`)
  // bundled onto lines 3 and 4: each segment [generated column, source, line, column].
  const map = { sources: ['src/plugin.ts'], mappings: ';;AAAA,MAAM;AACN,AAAA' };

  test('decodes the segments of every line', () => {
    assert.deepEqual(decodeMappings(map.mappings), [[], [], [[0, 0, 0, 0], [6, 0, 0, 6]], [[0, 0, 1, 0], [0, 0, 1, 0]]]);
    assert.equal(decodeMappings('A!A'), undefined);
  });

  test('maps the positions of a stack in the bundle to the source', () => {
    const positions = SourcePositions.of(map);
    assert.ok(positions);
    assert.equal(positions.lookup(3, 8), 'src/plugin.ts:1:7');
    assert.equal(positions.lookup(4, 1), 'src/plugin.ts:2:1');
    assert.equal(positions.lookup(1, 1), undefined, 'an unmapped line');
    const stack = 'reconcile@target/x.wasm.build/plugin.js:3:9\nrun@target/x.wasm.build/plugin.js:1:1\nother@lib.js:3:9';
    assert.equal(
      positions.mapStack(stack),
      'reconcile@src/plugin.ts:1:7\nrun@target/x.wasm.build/plugin.js:1:1\nother@lib.js:3:9',
    );
    assert.equal(SourcePositions.of(undefined), undefined);
  });
});
